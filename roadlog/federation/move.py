"""A topic moved to another member cluster (issue 43, docs/federation.md,
"Topic moves"): ``roadlog topic move NAME --to CLUSTER``.

The protocol, driven from here with an admin token good on the directory
and both members (one root in a local federation):

1. The target makes the topic with the source's spec (a leftover copy of an
   earlier failed move is deleted first: the directory's home is the source).
2. Bulk copy: each partition's batches read from the source (Fetch) and
   stored at the target at the same offsets (ImportTopic) while the source
   keeps taking writes; again for what came meanwhile, until what is left
   is small (``tail_pings``) or ``bulk_rounds`` passed.
3. Fence: the source refuses the topic's appends and offset commits
   (FenceTopic, UNAVAILABLE, which producers retry); its ends are final.
4. Tail: the rest copied, read at the fence's index; then the state
   (ExportTopicState at the fence: producer ids, epochs and sequences,
   consumer-group offsets, heat maps); the target's ends checked equal.
5. Flip: the directory's home moves (MoveTopicHome, source -> target only
   if it is still the source), then the source deletes its copy, and
   answers the topic with the redirect from then on; clients follow.

Invariants: the directory names one home at every moment; before the flip
the source holds every acknowledged ping (the target's copy is never
served), after it the target holds every one the source acknowledged
(its ends equal the fenced source's) with the same offsets, so producers'
retries are answered as duplicates and consumers resume where they
committed. A failure before the flip lifts the fence and deletes the
target's copy: the topic stays whole at the source. A mover lost after the
flip leaves the source's copy fenced (UNAVAILABLE, no redirect yet); the
same move run again finds the home moved and deletes that copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from roadlog.client import Connection
from roadlog.client_tls import ClientTLS
from roadlog.errors import Code, RoadlogError
from roadlog.federation.directory import Directory
from roadlog.federation.home import Home, home_of
from roadlog.v1 import client_pb2, federation_pb2, topics_pb2

log = logging.getLogger("roadlog.federation.move")
IMPORT_BYTES = 4 << 20  # of batches an ImportTopic carries (a Raft entry takes 8 MiB of ops)
FETCH_PINGS = 50_000


class NotHere(RoadlogError):
    """A pinned cluster named another home for the topic: it holds none."""


class Pinned(Connection):
    """A connection to one cluster that never follows a redirect: a mover
    must not import into (or fence) whatever cluster a refusal names."""

    def follow(self, home: Home) -> None:
        raise NotHere(
            Code.FAILED_PRECONDITION,
            f"{self.servers} named another home for the topic ({home.cluster}): not followed",
        )


def moved_batches(
    partition: int, resp: client_pb2.FetchResponseView
) -> list[federation_pb2.MovedBatch]:
    """A fetch's batches as they move: each one's count is up to the next
    one's base (the last one's: up to ``next_offset``)."""
    out = []
    bases = [b.base_offset for b in resp.batches] + [resp.next_offset]
    for b, end in zip(resp.batches, bases[1:], strict=True):
        out.append(
            federation_pb2.MovedBatch(
                partition=partition,
                base_offset=b.base_offset,
                count=end - b.base_offset,
                append_ms=b.append_ms,
                batch=b.batch,
            )
        )
    return out


@dataclass
class MoveReport:
    """What a move did, and how long its parts took (seconds)."""

    topic: str
    source: str
    target: str
    pings: int = 0  # copied
    bulk_rounds: int = 0
    bulk_s: float = 0.0
    fenced_s: float = 0.0  # from the fence to the source's copy deleted (writes wait)
    total_s: float = 0.0
    producers: int = 0
    groups: int = 0
    producers_unmapped: int = 0
    ends: list[int] = field(default_factory=list)

    @property
    def pings_per_s(self) -> float:
        copy_s = self.bulk_s + self.fenced_s
        return self.pings / copy_s if copy_s > 0 else 0.0

    def as_json(self) -> dict[str, object]:
        return {
            "topic": self.topic,
            "source": self.source,
            "cluster": self.target,
            "pings": self.pings,
            "bulk_rounds": self.bulk_rounds,
            "bulk_s": round(self.bulk_s, 3),
            "fenced_s": round(self.fenced_s, 3),
            "total_s": round(self.total_s, 3),
            "pings_per_s": round(self.pings_per_s),
            "producers": self.producers,
            "groups": self.groups,
            "producers_unmapped": self.producers_unmapped,
        }


class TopicMove:
    """One move of ``topic`` to member ``target`` (see the module's doc).
    ``before_fence``: called once the bulk copy is done (tests and the
    bench kill or measure there)."""

    def __init__(
        self,
        directory: Directory,
        topic: str,
        target: str,
        tls: ClientTLS | None = None,
        tail_pings: int = 20_000,
        bulk_rounds: int = 5,
        timeout: float = 30.0,
        on_round: Callable[[int], None] | None = None,
    ) -> None:
        self.directory = directory
        self.topic = topic
        self.target = target
        self.tls = tls if tls is not None else directory.tls
        self.tail_pings = tail_pings
        self.bulk_rounds = bulk_rounds
        self.timeout = timeout
        self.on_round = on_round

    def run(self) -> MoveReport:
        self.directory.forget(self.topic)
        home = self.directory.lookup(self.topic)
        fed = self.directory.federation()
        member = next((m for m in fed.members if m.name == self.target), None)
        if member is None:
            raise RoadlogError(Code.NOT_FOUND, f"no member cluster {self.target!r}")
        if home.cluster == self.target:
            # Done before, or a mover lost after its flip: finish it (the
            # source's fenced copy deleted), else say it is there already.
            finished = self._finish(fed)
            if not finished:
                raise RoadlogError(
                    Code.ALREADY_EXISTS, f"topic {self.topic!r} has its home in {self.target!r}"
                )
            return MoveReport(self.topic, finished[0], self.target)
        report = MoveReport(self.topic, home.cluster, self.target)
        start = time.monotonic()
        with (
            Pinned(home.queue_servers, timeout=self.timeout, tls=self.tls) as src,
            Pinned(member.queue_servers, timeout=self.timeout, tls=self.tls) as dst,
        ):
            record = self._describe(src).topic
            if record.partition_groups:
                raise RoadlogError(
                    Code.FAILED_PRECONDITION,
                    f"topic {self.topic!r} is placed in data groups: only a topic held in "
                    "group 0 moves yet (docs/federation.md, 'Topic moves')",
                )
            self._make_copy(dst, record.spec)
            fenced_at = 0.0
            try:
                ends = self._bulk(src, dst, report)
                report.bulk_s = time.monotonic() - start
                fenced_at = time.monotonic()
                fence = src.call("FenceTopic", federation_pb2.FenceTopicRequest(topic=self.topic))
                log.info("move fenced", extra={"topic": self.topic, "index": fence.applied_index})
                final = list(fence.next_offsets)
                ends = self._copy(src, dst, ends, final, report, fence.applied_index)
                state = src.call(
                    "ExportTopicState",
                    federation_pb2.ExportTopicStateRequest(
                        topic=self.topic, min_applied_index=fence.applied_index
                    ),
                )
                imported = dst.call(
                    "ImportTopic",
                    federation_pb2.ImportTopicRequest(
                        topic=self.topic,
                        producers=state.producers,
                        groups=state.groups,
                        rows=state.rows,
                    ),
                )
                report.producers, report.groups = len(state.producers), len(state.groups)
                report.producers_unmapped = imported.producers_unmapped
                if list(imported.next_offsets) != final:
                    raise RoadlogError(
                        Code.INTERNAL,
                        f"the target's ends {list(imported.next_offsets)} are not the "
                        f"source's {final}",
                    )
                report.ends = final
                self._flip(home.cluster)
            except BaseException:
                self._abandon(src, dst, fenced=bool(fenced_at))
                raise
            self._drop_source(src)
            report.fenced_s = time.monotonic() - fenced_at
        self.directory.learn(self.topic, home_of(member.name, member.queue_servers, member.http))
        report.total_s = time.monotonic() - start
        log.info("topic moved", extra=report.as_json())
        return report

    # ------------------------------------------------------------- steps

    def _describe(self, conn: Connection) -> topics_pb2.TopicDescription:
        d = conn.call("DescribeTopic", client_pb2.DescribeTopicRequest(name=self.topic))
        assert isinstance(d, topics_pb2.TopicDescription)
        return d

    def _make_copy(self, dst: Connection, spec: topics_pb2.TopicSpec) -> None:
        """The topic made on the target, a leftover copy deleted first."""
        try:
            self._describe(dst)
        except NotHere:
            pass
        except RoadlogError as e:
            if e.code != Code.NOT_FOUND:
                raise
        else:
            log.info("deleting a leftover copy", extra={"topic": self.topic})
            dst.call("DeleteTopic", client_pb2.DeleteTopicRequest(name=self.topic))
        dst.call("CreateTopic", client_pb2.CreateTopicRequest(spec=spec))

    def _bulk(self, src: Connection, dst: Connection, report: MoveReport) -> list[int]:
        """Rounds of copying while the source takes writes: the target's ends."""
        ends = [p.first_offset for p in self._describe(src).partitions]
        for n in range(1, self.bulk_rounds + 1):
            upto = [p.next_offset for p in self._describe(src).partitions]
            left = sum(u - e for u, e in zip(upto, ends, strict=True))
            if n > 1 and left <= self.tail_pings:
                break
            ends = self._copy(src, dst, ends, upto, report, 0)
            report.bulk_rounds = n
            if self.on_round is not None:
                self.on_round(n)
        return ends

    def _copy(
        self,
        src: Connection,
        dst: Connection,
        ends: list[int],
        upto: list[int],
        report: MoveReport,
        fence: int,
    ) -> list[int]:
        """Every partition's pings [ends[p], upto[p]) copied, in imports of
        at most IMPORT_BYTES; the target's ends after."""
        ends = list(ends)
        pending: list[federation_pb2.MovedBatch] = []
        size = 0

        def send() -> None:
            nonlocal size
            if pending:
                req = federation_pb2.ImportTopicRequest(topic=self.topic, batches=pending)
                dst.call("ImportTopic", req)
                report.pings += sum(b.count for b in pending)
                pending.clear()
                size = 0

        for p, stop in enumerate(upto):
            while ends[p] < stop:
                req = client_pb2.FetchRequest(
                    topic=self.topic,
                    partition=p,
                    offset=ends[p],
                    max_pings=FETCH_PINGS,
                    min_applied_index=fence,
                )
                resp = src.call("Fetch", req, response=client_pb2.FetchResponseView)
                if resp.first_offset > ends[p]:
                    ends[p] = resp.first_offset  # retention trimmed the rest meanwhile
                batches = [b for b in moved_batches(p, resp) if b.base_offset < stop]
                if not batches:
                    break
                for b in batches:
                    if b.base_offset + b.count > stop:
                        break  # past what this round copies: the next one's
                    pending.append(b)
                    size += len(b.batch)
                    ends[p] = b.base_offset + b.count
                    if size >= IMPORT_BYTES:
                        send()
                else:
                    continue
                break
        send()
        return ends

    def _flip(self, source: str) -> None:
        """The directory's home moved; an answer lost is asked again."""
        req = federation_pb2.MoveTopicHomeRequest(
            topic=self.topic, source=source, target=self.target
        )
        try:
            self.directory.conn.call("MoveTopicHome", req)
        except RoadlogError as e:
            if e.code not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                raise
            self.directory.forget(self.topic)
            if self.directory.lookup(self.topic).cluster != self.target:
                raise
        self.directory.forget(self.topic)

    def _abandon(self, src: Connection, dst: Connection, fenced: bool) -> None:
        """A move failed before its flip: the fence lifted, the copy deleted
        (best effort: a copy left behind is deleted by the next move)."""
        if fenced:
            try:
                lift = federation_pb2.FenceTopicRequest(topic=self.topic, lift=True)
                src.call("FenceTopic", lift)
            except RoadlogError as e:  # the source keeps refusing writes: said loudly
                log.error("the fence could not be lifted", extra={"why": e.message})
        try:
            dst.call("DeleteTopic", client_pb2.DeleteTopicRequest(name=self.topic), timeout=5)
        except RoadlogError as e:
            log.warning("the target's copy is left", extra={"topic": self.topic, "why": e.message})

    def _finish(self, fed: federation_pb2.Federation) -> list[str]:
        """The members other than the home that still hold the topic fenced
        for a move (a mover lost after its flip): their copies deleted;
        their names."""
        done = []
        for m in fed.members:
            if m.name == self.target:
                continue
            with Pinned(m.queue_servers, timeout=self.timeout, tls=self.tls) as conn:
                try:
                    record = self._describe(conn).topic
                except RoadlogError:
                    continue  # not there (or a redirect to the home), or down: nothing to do
                if record.moving:
                    self._drop_source(conn)
                    log.info("move finished", extra={"topic": self.topic, "source": m.name})
                    done.append(m.name)
        return done

    def _drop_source(self, src: Connection) -> None:
        """The source's copy deleted: from now on it answers with the redirect."""
        src.call("DeleteTopic", client_pb2.DeleteTopicRequest(name=self.topic), timeout=60)
