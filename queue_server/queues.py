"""The queue server's core, sans-I/O: a write queue only leaders drain
(each item by the leader of its Raft group), and a read queue any node may
steal from once it has applied the read's fence (in the read's group).
Nodes pull: each grants credit, and work is handed out only against it, so
a busy node takes less and an idle one steals more.

Time is passed in (``now``, in seconds); nothing here blocks or does I/O.
Invariants: an item is queued, handed to exactly one worker, or finished;
work a worker took and did not finish goes back to the front of its queue
when that worker leaves, unless its deadline passed or the streams of
MAX_STREAM_BREAKS workers that held it broke (then it is dropped and
reported: a request whose answer breaks every node's stream must not circle
forever; a worker answering "not the leader" is no break), or it is a write
whose repetition is not harmless (``replayable``): the node may have done
it before it left, so it is dropped and reported as of unknown outcome,
never done a second time behind its client's back; items whose
deadline passed are never handed out, and are dropped and reported; a read
that waits for its fence waits in its client's place, within its client's
bounds;
the queues never hold more than their bounds (items and bytes, in all and
per client), and are fair between clients
(``fair.FairQueue``): one client's flood neither fills the queue for others
nor delays their requests behind it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from queue_server.fair import FairQueue, Full
from queue_server.parts import replayable_part
from roadlog.limits import CLIENT_MESSAGE_BYTES
from roadlog.rpc import Kind as Kind  # which queue: declared with the rpcs
from roadlog.v1 import client_pb2


class QueueFull(Exception):
    """The queue is at its bound; the client should back off."""


# How many workers holding one item may have their stream break before it
# is given up (a node restarting is once or twice; a request that breaks
# every stream it rides on is forever).
MAX_STREAM_BREAKS = 3


@dataclass(slots=True)
class Item:
    id: int
    kind: Kind
    method: str
    request: bytes
    deadline: float
    enqueued: float
    fence: int = 0
    attempts: int = 0  # times a worker handed it back (not the leader any more, say)
    client: str = ""  # whose request: the unit of fairness
    deliveries: int = 0  # times handed to a worker
    broken: int = 0  # times a worker holding it left (its stream broke)
    principal: str = ""  # the authenticated identity's client id ("": none), for the node
    # Its scopes, for an rpc whose group's topic the node checks
    # (``Rpc.group_topic``); () for every other.
    scopes: tuple[str, ...] = ()
    # A self-registered identity's (its scopes above, then): topics closed
    # to open produce are checked by the node (``WorkItem.registered``).
    registered: bool = False
    group: int = 0  # its Raft group: 0, the metadata group, or a data group
    # The queue server's own request (a client's Authenticate when it
    # connects), not a client's: a fenced one does not make reads flowing.
    own: bool = False

    @property
    def size(self) -> int:
        """What it weighs in the queue's byte bounds."""
        return len(self.request)


@dataclass(slots=True)
class Worker:
    id: int
    node_id: int
    is_leader: bool = False
    term: int = 0
    applied: int = 0
    write_credit: int = 0
    read_credit: int = 0
    inflight: dict[int, Item] = field(default_factory=dict)
    taken_writes: int = 0
    taken_reads: int = 0
    # Its data groups (group 0 is the fields above): group -> (leads it,
    # term, applied index).
    groups: dict[int, tuple[bool, int, int]] = field(default_factory=dict)
    # False: a worker process's link, which runs data groups only (the
    # fields above say nothing); its node's main process serves group 0.
    runs_group_0: bool = True

    def applied_in(self, group: int) -> int:
        """Its applied index in ``group`` (-1: it does not run that group)."""
        if group == 0:
            return self.applied if self.runs_group_0 else -1
        g = self.groups.get(group)
        return g[2] if g is not None else -1

    def leads(self) -> Iterator[tuple[int, int]]:
        """(group, term) of each group it leads."""
        if self.is_leader and self.runs_group_0:
            yield 0, self.term
        for g, (lead, term, _) in self.groups.items():
            if lead:
                yield g, term


@dataclass(slots=True)
class Expired:
    item: Item
    reason: str
    gave_up: bool = False  # dropped for breaking streams, not for its deadline


# Writes that store nothing new when done again: heartbeats, leaving, the
# same offsets committed again, the same heat map put again.
_HARMLESS_AGAIN = frozenset({"Heartbeat", "LeaveGroup", "CommitOffsets", "PutHeatmap"})
UNKNOWN_OUTCOME = (
    "the node that took it left before answering, so whether it was done is unknown; "
    "it is not done again behind your back (an idempotent producer's retry is stored once)"
)


def replayable(it: Item) -> bool:
    """Whether ``it`` may be handed to another node after one that took it
    left: reads, the harmless writes, and publishes whose every request
    carries a producer id (the state machine stores a retried (producer,
    sequence) once). Anything else (a publish without a producer id, a topic
    created or deleted, a member joining) might be done twice."""
    if it.kind == Kind.READ or it.method in _HARMLESS_AGAIN:
        return True
    try:
        if it.method == "Publish":
            return bool(client_pb2.PublishRequestView.FromString(it.request).producer_id)
        if it.method == "PublishBatch":
            raws = client_pb2.PublishBatchRequestView.FromString(it.request).requests
            views = [client_pb2.PublishRequestView.FromString(r) for r in raws]
            return bool(views) and all(v.producer_id for v in views)
        if it.method == "AppendPart":  # a publish's part in a data group
            return replayable_part(it.request)
    except DecodeError:
        return True  # refused as malformed wherever it goes: nothing is done
    return False


def per_client_share(total: int) -> int:
    """How much of a queue one client may hold: a quarter, at least 16."""
    return max(16, total // 4)


def per_client_bytes(total: int) -> int:
    """How many bytes of a queue one client may hold: a quarter, at least
    one request of the largest size a client may send."""
    return max(CLIENT_MESSAGE_BYTES, total // 4)


MAX_QUEUED_BYTES = 256 << 20  # per queue (writes, reads): the default bound
# Fenced reads count as coming in for this long after the last one arrived.
READS_FLOWING_S = 1.0


class WorkQueues:
    def __init__(
        self,
        max_writes: int = 10_000,
        max_reads: int = 10_000,
        max_per_client: int | None = None,
        max_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        client_bytes = per_client_bytes(max_bytes)
        self.queues: dict[Kind, FairQueue[Item]] = {
            Kind.WRITE: FairQueue(
                max_writes,
                max_per_client or per_client_share(max_writes),
                max_bytes,
                client_bytes,
            ),
            Kind.READ: FairQueue(
                max_reads, max_per_client or per_client_share(max_reads), max_bytes, client_bytes
            ),
        }
        self.workers: dict[int, Worker] = {}
        self._rr = 0  # rotates ties between equally idle readers
        self.fenced_read_at = float("-inf")  # when the last fenced read arrived
        self._dropped: list[Expired] = []  # not requeued on disconnect; expire() reports them
        self._grouped = False  # an item of a data group was ever submitted

    # ------------------------------------------------------------ clients

    def submit(self, item: Item) -> None:
        self._grouped = self._grouped or item.group != 0
        try:
            self.queues[item.kind].push(item)
        except Full as e:
            raise QueueFull(f"{item.kind.name.lower()} {e}") from None
        if item.kind == Kind.READ and item.fence and not item.own:
            self.fenced_read_at = max(self.fenced_read_at, item.enqueued)

    def reads_flowing(self, now: float) -> bool:
        """Fenced reads of clients came in lately: nodes that tell their
        applied index promptly can take them too, not only the leader
        (whose answer to the write told its index). The queue server's own
        (each client's Authenticate as it connects) do not count: the
        leader takes them at once, and counted, every connect had every
        leader tell each commit with an APPEND of its own for a second or
        two (bench/profiles/write-path.md, session 25)."""
        return now - self.fenced_read_at < READS_FLOWING_S

    def cancel(self, item_id: int) -> bool:
        """A client gave up: forget the item if it is still queued; if a
        worker holds it, it is not requeued when that worker leaves."""
        for w in self.workers.values():
            it = w.inflight.get(item_id)
            if it is not None:
                it.deadline = float("-inf")
        return any(q.remove_if(lambda it: it.id == item_id) for q in self.queues.values())

    def expire(self, now: float) -> list[Expired]:
        """Drop queued items whose deadline passed; report them, and the
        items a leaving worker held that were not requeued."""
        out, self._dropped = self._dropped, []
        for kind, q in self.queues.items():
            for it in q.remove_if(lambda it: it.deadline <= now):
                why = self._why_waiting(kind, it)
                out.append(Expired(it, f"not done before the deadline: {why}"))
        return out

    def drop_unreachable_fences(
        self,
        commit_index: int,
        queued_before: float,
        group_commits: dict[int, int] | None = None,
    ) -> list[Item]:
        """Reads queued before ``queued_before`` whose fence is beyond the
        highest index any node has committed in the read's group
        (``commit_index`` for group 0, ``group_commits`` for data groups; a
        group no node told of is left alone): no write was ever answered
        with such an index, so waiting would only run out the deadline."""
        commits = {**(group_commits or {}), 0: commit_index}
        return self.queues[Kind.READ].remove_if(
            lambda it: it.enqueued < queued_before and it.fence > commits.get(it.group, 1 << 63)
        )

    def awaited_fence(self) -> int:
        """The highest fence of the queued reads that no connected worker
        has told it reached (0: none waits for a fence). Workers below it
        are asked to tell their applied index promptly; otherwise they tell
        it only now and then. Cheap while no read is queued."""
        rq = self.queues[Kind.READ]
        if not len(rq):
            return 0
        applied = max((w.applied_in(0) for w in self.workers.values()), default=0)
        return max((it.fence for it in rq if it.group == 0 and it.fence > applied), default=0)

    def _why_waiting(self, kind: Kind, it: Item) -> str:
        if not self.workers:
            return "no node is connected to this queue server"
        of = f" of group {it.group}" if it.group else ""
        if kind == Kind.WRITE and self.leader(it.group) is None:
            return f"no leader{of}: no majority of nodes is reachable"
        if kind == Kind.READ and not any(
            w.applied_in(it.group) >= it.fence for w in self.workers.values()
        ):
            return f"no node has applied index {it.fence}{of} yet"
        return "all nodes are busy"

    # ------------------------------------------------------------ workers

    def connect(self, worker_id: int, node_id: int, runs_group_0: bool = True) -> None:
        """A node's link; ``runs_group_0`` False: a worker process's, which
        serves its data groups only."""
        self.workers[worker_id] = Worker(worker_id, node_id, runs_group_0=runs_group_0)

    def update(
        self,
        worker_id: int,
        is_leader: bool,
        term: int,
        applied: int,
        groups: Iterable[tuple[int, bool, int, int]] | None = None,
    ) -> None:
        """The worker's role, term and applied index in group 0, and in
        ``groups`` (group, leads it, term, applied) its data groups (None:
        as told before)."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.is_leader, w.term, w.applied = is_leader, term, max(applied, 0)
            if groups is not None:
                w.groups = {g: (lead, t, max(a, 0)) for g, lead, t, a in groups if g}

    def grant(self, worker_id: int, writes: int, reads: int) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.write_credit = min(w.write_credit + max(writes, 0), 1 << 20)
            w.read_credit = min(w.read_credit + max(reads, 0), 1 << 20)

    def disconnect(self, worker_id: int, now: float) -> list[Item]:
        """The worker is gone: what it held goes back to the front, in order,
        and is returned; what is past its deadline, was held by
        MAX_STREAM_BREAKS workers that left, or is a write it may have done
        that must not be done twice (not ``replayable``) is dropped instead
        (``expire`` reports it)."""
        w = self.workers.pop(worker_id, None)
        if w is None:
            return []
        back: list[Item] = []
        for it in sorted(w.inflight.values(), key=lambda it: it.id):
            it.broken += 1
            if it.deadline <= now:
                self._dropped.append(Expired(it, "not done before the deadline: its node left"))
            elif not replayable(it):
                self._dropped.append(Expired(it, UNKNOWN_OUTCOME))
            elif it.broken >= MAX_STREAM_BREAKS:
                self._dropped.append(
                    Expired(
                        it,
                        f"given up after {it.broken} nodes took it and their work streams "
                        "broke (is the request or its answer too big?)",
                        gave_up=True,
                    )
                )
            else:
                back.append(it)
        for kind in Kind:
            self.queues[kind].push_front([it for it in back if it.kind == kind])
        return back

    def complete(self, worker_id: int, item_id: int) -> Item | None:
        w = self.workers.get(worker_id)
        if w is None:
            return None
        return w.inflight.pop(item_id, None)

    def retry(self, worker_id: int, item_id: int) -> Item | None:
        """The worker could not do it (not the leader any more, say): queue
        it again at the front for another worker."""
        it = self.complete(worker_id, item_id)
        if it is not None:
            it.attempts += 1
            self.queues[it.kind].push_front([it])
        return it

    # ----------------------------------------------------------- dispatch

    def runs_group(self, group: int) -> bool:
        """Whether a connected node told of data group ``group``."""
        return any(group in w.groups for w in self.workers.values())

    def leader(self, group: int = 0) -> Worker | None:
        """The worker that leads ``group`` at the highest term told."""
        return self.leaders().get(group)

    def leaders(self) -> dict[int, Worker]:
        """Each group's leader (the highest term told wins)."""
        out: dict[int, tuple[int, Worker]] = {}
        for w in self.workers.values():
            for g, term in w.leads():
                if g not in out or term > out[g][0]:
                    out[g] = (term, w)
        return {g: w for g, (_, w) in out.items()}

    def dispatch(self, now: float) -> list[tuple[int, Item]]:
        """Hand out what can go now: (worker id, item) pairs."""
        out: list[tuple[int, Item]] = []
        if self._grouped:
            self._dispatch_grouped_writes(now, out)
        else:
            self._dispatch_writes(now, out)
        self._dispatch_reads(now, out)
        return out

    def _hand(self, w: Worker, it: Item, out: list[tuple[int, Item]]) -> None:
        it.deliveries += 1
        w.inflight[it.id] = it
        out.append((w.id, it))

    def _dispatch_grouped_writes(self, now: float, out: list[tuple[int, Item]]) -> None:
        """Writes of several groups: each to its group's leader, against
        that leader's credit, fair between clients (a client's next write
        waits while its group has no leader with credit, keeping its order)."""
        wq = self.queues[Kind.WRITE]
        leaders = self.leaders()

        def takeable(it: Item) -> bool:
            w = leaders.get(it.group)
            return it.deadline > now and w is not None and w.write_credit > 0

        while any(w.write_credit > 0 for w in leaders.values()):
            it = wq.take_first(takeable)
            if it is None:
                break
            w = leaders[it.group]
            w.write_credit -= 1
            w.taken_writes += 1
            self._hand(w, it, out)

    def _dispatch_writes(self, now: float, out: list[tuple[int, Item]]) -> None:
        """Writes of group 0 alone (no data group in use): to its leader."""
        wq = self.queues[Kind.WRITE]
        lead = self.leader()
        expired: list[Item] = []
        while lead is not None and lead.write_credit > 0:
            it = wq.pop()
            if it is None:
                break
            if it.deadline <= now:
                expired.append(it)  # expire() reports it
                continue
            lead.write_credit -= 1
            lead.taken_writes += 1
            self._hand(lead, it, out)
        wq.push_front(expired)

    def _dispatch_reads(self, now: float, out: list[tuple[int, Item]]) -> None:
        # Reads: the next one (fair between clients) that some node can take
        # now; one that waits for its fence, or is past its deadline (expire()
        # reports it), stays where it is.
        rq = self.queues[Kind.READ]
        while any(w.read_credit > 0 for w in self.workers.values()):
            it = rq.take_first(lambda it: it.deadline > now and self._can_read(it))
            if it is None:
                break
            w = self._reader_for(it)
            assert w is not None  # _can_read said so
            w.read_credit -= 1
            w.taken_reads += 1
            self._hand(w, it, out)

    def _can_read(self, it: Item) -> bool:
        return any(
            w.read_credit > 0 and w.applied_in(it.group) >= it.fence for w in self.workers.values()
        )

    def _reader_for(self, it: Item) -> Worker | None:
        """The eligible worker with the most read credit left (the idlest)."""
        best: Worker | None = None
        ws = list(self.workers.values())
        if not ws:
            return None
        self._rr = (self._rr + 1) % len(ws)
        for w in ws[self._rr :] + ws[: self._rr]:
            if (
                w.read_credit > 0
                and w.applied_in(it.group) >= it.fence
                and (best is None or w.read_credit > best.read_credit)
            ):
                best = w
        return best

    def depth(self, kind: Kind) -> int:
        return len(self.queues[kind])
