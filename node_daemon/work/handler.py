"""The node's side of the work protocol: do a work item of a queue server
(``queue_link`` pulls them) and answer it. Writes are validated here (on the
leader, before they enter the log) and proposed; reads are answered from this
node's own LMDB once it has applied the read's fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from prometheus_client import Histogram

from node_daemon import metrics
from node_daemon.replica.commands import PAST_DEADLINE
from node_daemon.replica.remote import ReplicaView
from node_daemon.replica.replica import NotLeader, Replica
from node_daemon.state.consumer_groups import name_taken
from node_daemon.state.heatmaps import Contribution
from node_daemon.state.producers import quota_refusal
from node_daemon.state.responses import OpResult, publish_batch_response
from node_daemon.state.topics import normalized_spec
from node_daemon.work import part_cork
from node_daemon.work.appends import (
    MAX_PINGS_PER_OP,
    MalformedRequest,
    PreparedAppend,
    prepare_appends,
    split_by_group,
)
from node_daemon.work.consumer_group_coordinator import ConsumerGroupCoordinator
from node_daemon.work.federation import FederationWork
from node_daemon.work.group_access import readable_group, readable_groups
from node_daemon.work.identities import IdentityWork, RegistrationCeiling
from node_daemon.work.identities import propose_client as propose_client  # the Admin service's
from node_daemon.work.open_produce import closed_to
from roadlog import columnar, round_trace
from roadlog.errors import Code, RoadlogError, Throttled
from roadlog.geo import Region, parse_region
from roadlog.limits import (
    CLIENT_MESSAGE_BYTES,
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    PAGE_BYTES,
)
from roadlog.placement import group_of
from roadlog.rpc import ROUTED
from roadlog.v1 import (
    client_pb2,
    command_pb2,
    groups_pb2,
    topics_pb2,
    work_pb2,
)
from roadlog.validation import BatchRejected

log = logging.getLogger("roadlog.worker")

RETRY_ELSEWHERE = Code.UNAVAILABLE  # the queue server gives it to another node
MAX_BATCH_REQUESTS = 4096  # requests in one PublishBatch
EAGER_PUBLISHES = 8  # this many waiting publishes are validated without waiting for the log
# Publishes up to this many bytes are validated on the event loop: validation
# holds the GIL either way, and a thread only adds hand-overs (inline gave
# 19-24% more ingest with 1000-ping messages); beyond it (about 15 ms of
# work) a thread keeps the loop free for heartbeats.
INLINE_VALIDATE_BYTES = 4 << 20


# Metric children bound once: labels() per work item costs more than the count.
_WORK_DONE = {True: metrics.WORK_DONE.labels("write"), False: metrics.WORK_DONE.labels("read")}
_VALIDATE_SECONDS = metrics.STAGE_SECONDS.labels("validate")
# Parts of split publishes proposed in one turn of a data group's leader
# (``_propose_parts``): above 1, corked into fewer ops.
_CORKED_PARTS = Histogram(
    "roadlog_corked_parts",
    "parts of split publishes a data group's leader took in one turn and corked",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)

Outcome = OpResult | BaseException  # a publish's result, or why it has none
SpanAnswer = tuple[int, str, bytes]  # a span's code, message and response
# A part waiting for this turn's cork: its op, deadline and answers' future.
_Part = tuple[command_pb2.Op, float | None, "asyncio.Future[list[SpanAnswer]]"]


PRODUCER_CATCH_UP_S = 2.0  # how long a data group's leader waits for a read of group 0
LEADER_CATCH_UP_S = 2.0  # how long a new leader waits to apply its term's first entry
PLACEMENT_WAIT_S = 3.0  # how long a data group's leader waits for a new topic to be placed
# A consumer-group member's call that names its member (``_as_member``).
_MemberRequest = (
    client_pb2.HeartbeatRequest | client_pb2.CommitOffsetsRequest | client_pb2.LeaveGroupRequest
)


@dataclass(slots=True)
class SplitResult(OpResult):
    """Publishes group 0's leader validated and split: the refusals (as
    OpResult's response) and the parts for the data groups' leaders."""

    parts: list[work_pb2.WorkPart] = field(default_factory=list)


class _Call:
    """The publishes of one work item (a PublishBatch, or a lone Publish),
    answered together: one future for the call, not one per publish.

    Invariant: ``future`` gets its result exactly when every publish has an
    outcome; each publish's first outcome stands."""

    __slots__ = (
        "deadline", "future", "open_scopes", "outcomes", "principal", "remaining", "requests"
    )  # fmt: skip

    def __init__(
        self,
        requests: list[bytes],
        principal: str = "",
        deadline: float | None = None,
        open_scopes: tuple[str, ...] | None = None,
    ) -> None:
        self.requests = requests
        # The authenticated identity's client id: the publishes' client id
        # ("": the one each request declares, client_auth off).
        self.principal = principal
        # A self-registered identity's scopes: topics closed to open produce
        # are checked against them (``open_produce``); None: not checked.
        self.open_scopes = open_scopes
        # When (monotonic) the client stops waiting: not proposed after it.
        self.deadline = deadline
        self.outcomes: list[Outcome | None] = [None] * len(requests)
        self.remaining = len(requests)
        self.future: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()

    def settle(self, i: int, outcome: Outcome) -> None:
        if self.outcomes[i] is not None:
            return
        self.outcomes[i] = outcome
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.outcomes)  # type: ignore[arg-type]  # all set now

    def settle_rest(self, outcome: Outcome) -> None:
        for i, o in enumerate(self.outcomes):
            if o is None:
                self.settle(i, outcome)


# A write is the node's until receipt + WorkItem.budget_ms; the wall-clock
# deadline beside it counts also what passed before the node read the item
# (a paused leader's socket), unless it says the item waited more than this,
# which is taken for this node's clock being off, not for a wait.
MAX_WORK_LAG_S = 20.0
# Publishes are proposed only with this much of their deadline left: one
# merged op answers for all its publishes, and a publish about to expire
# must not make the op (and the others with it) too late for the log.
PROPOSE_MARGIN_S = 0.1
_monotonic = time.monotonic  # the deadlines' clock (a test moves it)


def item_deadline(item: work_pb2.WorkItem, now: float, now_unix: float) -> float:
    """The monotonic time by which ``item`` (a write with a budget) must be
    in the log: receipt (``now``) plus the budget the queue server gave,
    or less if its wall-clock deadline is nearer and this node's clock is
    believable (it says the item waited at most MAX_WORK_LAG_S)."""
    left = item.budget_ms / 1000
    if item.deadline_unix_ms:
        wall_left = item.deadline_unix_ms / 1000 - now_unix
        if left - wall_left <= MAX_WORK_LAG_S:
            left = min(left, wall_left)
    return now + left


def _in_time(calls: list[_Call], now: float) -> list[_Call]:
    """The calls whose deadline has not passed; the others are answered
    DEADLINE_EXCEEDED, nothing of them stored."""
    late = RoadlogError(Code.DEADLINE_EXCEEDED, PAST_DEADLINE)
    kept = []
    for call in calls:
        if call.deadline is not None and call.deadline <= now:
            call.settle_rest(late)
        else:
            kept.append(call)
    return kept


def _settle_spans(owners: list[tuple[_Call, int]], proposal: asyncio.Future[OpResult]) -> None:
    """Give each publish its share (its span) of a merged append op's result;
    ``owners[span]`` is the call and position of that span's publish."""
    if proposal.cancelled():
        gone = asyncio.CancelledError("the node stopped before answering")
        for call, i in owners:
            call.settle(i, gone)
        return
    err = proposal.exception()
    if err is not None:
        for call, i in owners:
            call.settle(i, err)
        return
    res = proposal.result()
    if res.spans:
        for (call, i), span in zip(owners, res.spans, strict=True):
            call.settle(i, span)
    else:
        for call, i in owners:
            call.settle(i, res)


def _settle_parts(
    futs: list[asyncio.Future[list[SpanAnswer]]],
    ranges: list[range],
    proposal: asyncio.Future[OpResult],
) -> None:
    """Give each corked part its spans' results (``ranges[k]``: part k's
    spans in the merged op's); an op refused whole refuses every part."""
    err: BaseException | None
    if proposal.cancelled():
        err = asyncio.CancelledError("the node stopped before answering")
    else:
        err = proposal.exception()
    for fut, span_range in zip(futs, ranges, strict=True):
        if fut.done():
            continue
        if err is not None:
            fut.set_exception(err)
            continue
        res = proposal.result()
        if res.spans:
            fut.set_result(
                [
                    (s.code, s.message, s.response)
                    for s in res.spans[span_range.start : span_range.stop]
                ]
            )
        else:
            fut.set_result([(res.code, res.message, res.response)] * len(span_range))


async def _placed(node: ReplicaView, name: str, topic_id: int) -> None:
    """Until data group replica ``node`` holds topic ``name`` with
    ``topic_id`` (placed by its leader as it follows group 0), up to
    PLACEMENT_WAIT_S: then UNAVAILABLE (the queue server tries again)."""
    deadline = time.monotonic() + PLACEMENT_WAIT_S
    while True:
        try:
            if node.sm.topic(name).id == topic_id or not topic_id:
                return
        except RoadlogError as e:
            if e.code != Code.NOT_FOUND:
                raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise RoadlogError(
                Code.UNAVAILABLE, f"topic {name!r} is not placed in group {node.group} yet"
            )
        with contextlib.suppress(TimeoutError):
            await node.wait_applied(node.sm.applied_index + 1, left)


def _open_scopes(item: work_pb2.WorkItem) -> tuple[str, ...] | None:
    """A self-registered caller's scopes, which topics closed to open
    produce are checked against (None: not such a caller)."""
    return tuple(item.scopes) if item.principal and item.registered else None


def failure_status(e: BaseException, method: str) -> tuple[Code, str]:
    """The status a client is answered with for a failed request."""
    if isinstance(e, NotLeader):
        return RETRY_ELSEWHERE, f"{e} (leader {e.leader})"
    if isinstance(e, RoadlogError):
        return e.code, e.message
    if isinstance(e, MalformedRequest | BatchRejected):
        return Code.INVALID_ARGUMENT, str(e)
    if isinstance(e, DecodeError | columnar.BatchDecodeError):
        return Code.INVALID_ARGUMENT, f"malformed request: {e}"
    if isinstance(e, asyncio.CancelledError):  # its proposal was given up: try again
        return RETRY_ELSEWHERE, str(e) or "cancelled"
    log.error("work item failed", exc_info=e, extra={"method": method})
    return Code.INTERNAL, f"{type(e).__name__}: {e}"


class WorkHandler(IdentityWork, FederationWork):
    """Turns work items into results against one Replica. A work item's
    method is an rpc of ``roadlog.rpc``; the method of this class named by
    its ``handler`` does it (``PublishBatch``: ``publish_batch``); those of
    identities, settings and topic access are ``IdentityWork``'s."""

    def __init__(self, node: Replica) -> None:
        self.node = node
        self.cpu = ThreadPoolExecutor(2, thread_name_prefix="work")
        self._regions: dict[tuple[str, int], Region] = {}
        self._publishes: list[_Call] = []
        self._waiting = 0  # publishes in self._publishes
        self._publish_wakeup = asyncio.Event()
        self._merger: asyncio.Task[None] | None = None
        self.groups = ConsumerGroupCoordinator(node)
        self._read_links: set[object] = set()  # queue servers where fenced reads come in
        self._placed_topics: set[str] = set()  # a data group's: topics seen placed here
        # Write items being done, by the item object (ids are per queue server,
        # and two may use the same): their deadlines on this monotonic clock.
        self._deadlines: dict[int, float] = {}
        self.registrations = RegistrationCeiling()  # the cluster's, as group 0's leader
        # Parts (AppendPart) of this turn, not yet proposed (``_cork_part``).
        self._parts_waiting: list[_Part] = []

    def reads_flowing(self, link: object, on: bool) -> None:
        """A queue server says fenced reads come in there lately (or no
        more). While any does, this node (as leader) tells its followers
        each commit at once, so that they can take such reads too."""
        before = bool(self._read_links)
        if on:
            self._read_links.add(link)
        else:
            self._read_links.discard(link)
        prompt = bool(self._read_links)
        if prompt != before:
            self.node.submit(lambda core: core.set_prompt_commit(prompt))

    async def run(
        self,
        item: work_pb2.WorkItem,
        handler: Callable[[work_pb2.WorkItem], Awaitable[OpResult]] | None = None,
    ) -> work_pb2.WorkResult:
        if handler is None and item.method in ROUTED:
            handler = getattr(self, ROUTED[item.method].handler)
        res = work_pb2.WorkResult(id=item.id)
        if handler is None:
            res.code, res.message = Code.UNIMPLEMENTED, f"no method {item.method}"
            return res
        if item.kind == work_pb2.WORK_KIND_WRITE and item.budget_ms:
            # Publishes carry it to the moment they enter the log (_Call).
            self._deadlines[id(item)] = item_deadline(item, _monotonic(), time.time())
        try:
            if item.kind == work_pb2.WORK_KIND_WRITE and self.node.is_leader:
                # What a leader checks before it proposes (topics, producer
                # ids, consumer groups, identities) is read from its state,
                # which must hold every write acknowledged before it led.
                await self.node.wait_caught_up_as_leader(LEADER_CATCH_UP_S)
            out = await handler(item)
            res.code, res.message, res.response = out.code, out.message, out.response
            if isinstance(out, SplitResult):
                res.parts.extend(out.parts)
        except Exception as e:
            res.code, res.message = failure_status(e, item.method)
            if isinstance(e, Throttled):
                res.retry_after_ms = max(1, int(e.retry_after_s * 1000))
        finally:
            self._deadlines.pop(id(item), None)
        if len(res.response) > CLIENT_MESSAGE_BYTES:
            # Never send what the client's hop refuses: it would break this
            # stream, and the request would be handed out again.
            res.code = Code.RESOURCE_EXHAUSTED
            res.message = (
                f"the answer of {len(res.response)} bytes is over the limit of "
                f"{CLIENT_MESSAGE_BYTES}: ask for less (a smaller max_bytes or page_size)"
            )
            res.response = b""
        _WORK_DONE[item.kind == work_pb2.WORK_KIND_WRITE].inc()
        return res

    # ---------------------------------------------------------------- writes

    async def publish(self, item: work_pb2.WorkItem) -> OpResult:
        deadline = self._deadlines.get(id(item))
        if self._splits():
            call = _Call([item.request], item.principal, deadline, _open_scopes(item))
            return await self._split(call, lone=True)
        return await self._publish(item.request, item.principal, deadline, _open_scopes(item))

    async def publish_batch(self, item: work_pb2.WorkItem) -> OpResult:
        """Every request of the batch goes the way of a lone publish, and
        gets its own result. If none could be taken because this node is not
        the leader, the whole item goes back to the queue for the leader."""
        try:
            requests = list(client_pb2.PublishBatchRequestView.FromString(item.request).requests)
        except DecodeError as e:
            raise MalformedRequest(f"malformed PublishBatchRequest: {e}") from None
        if not requests:
            raise MalformedRequest("a PublishBatch needs at least one request")
        if len(requests) > MAX_BATCH_REQUESTS:
            raise MalformedRequest(
                f"a PublishBatch holds at most {MAX_BATCH_REQUESTS} requests, not {len(requests)}"
            )
        call = _Call(requests, item.principal, self._deadlines.get(id(item)), _open_scopes(item))
        if self._splits():
            return await self._split(call, lone=False)
        outcomes = await self._enqueue(call)
        if all(isinstance(o, NotLeader) for o in outcomes):
            raise outcomes[0]  # type: ignore[misc]
        answers = [
            (o.code, o.message, o.response)
            if isinstance(o, OpResult)
            else (*failure_status(o, "PublishBatch"), b"")
            for o in outcomes
        ]
        return OpResult(response=publish_batch_response(answers))

    def _splits(self) -> bool:
        """Whether publishes are split here: on group 0 of a cluster whose
        topics are placed in data groups (fixed by its first topic)."""
        return self.node.group == 0 and self.node.sm.data_groups() > 1

    async def _split(self, call: _Call, lone: bool) -> SplitResult:
        """Publishes to topics placed in data groups (multi-raft), on group
        0's leader, which holds the topics and issues producer ids: checked
        and validated as they would be for an append, split by partition,
        and the partitions regrouped by group into one part per group (an
        AppendOp, a span per publish with pings there), which the queue
        server hands to that group's leader; it answers the client once
        every part is answered. A publish refused here is in no part: its
        refusal is in the result (``lone``: raised, as for a Publish)."""
        if not self.node.is_leader:
            raise NotLeader(self.node.core.lead)
        if not _in_time([call], _monotonic() + PROPOSE_MARGIN_S):
            raise RoadlogError(Code.DEADLINE_EXCEEDED, PAST_DEADLINE)
        n = len(call.requests)
        owners = [(call, i) for i in range(n)]
        clients = [call.principal] * n
        requests, owners, clients = self._open_produce_checked(call.requests, owners, clients)
        requests, owners, clients, _ = await self._producers_checked(requests, owners, clients)
        prepared, errors = await self._prepared(requests, clients)
        for i, e in errors.items():
            c, pos = owners[i]
            c.settle(pos, e)
        parts: list[work_pb2.WorkPart] = []
        for p in prepared:
            op = p.op.append
            topic = self.node.sm.topic(op.topic)
            positions = [owners[m][1] for m in p.members]
            if not topic.partition_groups:  # a topic of group 0 (made before placement)
                proposal = asyncio.ensure_future(self.node.propose_op(p.op, deadline=call.deadline))
                proposal.add_done_callback(
                    functools.partial(_settle_spans, [owners[m] for m in p.members])
                )
                continue
            for group, sub, spans in split_by_group(op, topic.partition_groups, topic.id):
                parts.append(
                    work_pb2.WorkPart(
                        group=group,
                        op=sub.SerializeToString(),
                        members=[positions[j] for j in spans],
                    )
                )
            for pos in positions:
                call.settle(pos, OpResult())  # answered by its parts
        outcomes = await call.future
        answers = [
            (o.code, o.message, o.response)
            if isinstance(o, OpResult)
            else (*failure_status(o, "Publish"), b"")
            for o in outcomes
        ]
        if lone:
            code, message, response = answers[0]
            if code:
                raise RoadlogError(Code.of(code), message)
            return SplitResult(response=response, parts=parts)
        return SplitResult(response=publish_batch_response(answers), parts=parts)

    async def _prepared(
        self, requests: list[bytes], clients: list[str]
    ) -> tuple[list[PreparedAppend], dict[int, Exception]]:
        """``prepare_appends`` of ``requests``: on the event loop up to
        INLINE_VALIDATE_BYTES, beyond it on a thread."""
        now_ms = int(time.time() * 1000)
        if sum(map(len, requests)) <= INLINE_VALIDATE_BYTES:
            return prepare_appends(requests, self._topic_lookup, now_ms, clients=clients)
        return await asyncio.get_running_loop().run_in_executor(
            self.cpu,
            functools.partial(
                prepare_appends, requests, self._topic_lookup, now_ms, clients=clients
            ),
        )

    async def append_part(self, item: work_pb2.WorkItem) -> OpResult:
        """A part of publishes group 0's leader validated and split (its
        producer ids checked there): appended in this data group as it is,
        corked with the other parts that reach this leader in the same turn
        (``_cork_part``). The answer: a PublishBatchResponse with one result
        per span. A topic this group has not placed yet (just made) is
        waited for a moment."""
        if self.node.group == 0:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a part is a data group's")
        op = command_pb2.Op()
        try:
            op.append.ParseFromString(item.request)
        except DecodeError as e:
            raise MalformedRequest(f"malformed AppendOp: {e}") from None
        await _placed(self.node, op.append.topic, op.append.topic_id)
        answers = await self._cork_part(op, self._deadlines.get(id(item)))
        return OpResult(response=publish_batch_response(answers))

    def _cork_part(
        self, op: command_pb2.Op, deadline: float | None
    ) -> asyncio.Future[list[SpanAnswer]]:
        """Queue a part for this turn's cork: the parts of every work item
        that reaches here before the cork runs (the items of one WorkItems
        frame run as tasks of one turn) are merged per topic
        (``part_cork``: those whose partitions do not overlap) and proposed
        as one op; each part is answered with its spans' results."""
        fut: asyncio.Future[list[SpanAnswer]] = asyncio.get_running_loop().create_future()
        self._parts_waiting.append((op, deadline, fut))
        if len(self._parts_waiting) == 1:
            asyncio.get_running_loop().call_soon(self._propose_parts)
        return fut

    def _propose_parts(self) -> None:
        """Propose this turn's parts (``_cork_part``): one op per cork of
        ``part_cork.corks``; a part within PROPOSE_MARGIN_S of its deadline
        is refused DEADLINE_EXCEEDED alone, never holding the others back."""
        waiting, self._parts_waiting = self._parts_waiting, []
        now = _monotonic() + PROPOSE_MARGIN_S
        late = RoadlogError(Code.DEADLINE_EXCEEDED, PAST_DEADLINE)
        kept = []
        for w in waiting:
            if w[1] is not None and w[1] <= now:
                if not w[2].done():
                    w[2].set_exception(late)
            else:
                kept.append(w)
        if kept:
            _CORKED_PARTS.observe(len(kept))
        for group in part_cork.corks([w[0].append for w in kept], MAX_PINGS_PER_OP):
            parts = [kept[i] for i in group]
            merged = parts[0][0]
            ranges = [range(len(merged.append.spans))]
            if len(parts) > 1:
                merged = command_pb2.Op()
                ranges = part_cork.merge([op.append for op, _, _ in parts], merged.append)
            self._propose_corked(parts, ranges, merged)

    def _propose_corked(
        self,
        parts: list[_Part],
        ranges: list[range],
        op: command_pb2.Op,
    ) -> None:
        deadlines = [d for _, d, _ in parts if d is not None]
        # The node's future itself (a stub's coroutine wrapped), as for publishes.
        proposal = asyncio.ensure_future(
            self.node.propose_op(op, deadline=min(deadlines, default=None))
        )
        futs = [fut for _, _, fut in parts]
        proposal.add_done_callback(functools.partial(_settle_parts, futs, ranges))

    async def _publish(
        self,
        request: bytes,
        principal: str = "",
        deadline: float | None = None,
        open_scopes: tuple[str, ...] | None = None,
    ) -> OpResult:
        call = _Call([request], principal, deadline, open_scopes)
        if self.node.cfg.merge_publishes:
            (outcome,) = await self._enqueue(call)
        else:
            await self._propose_publishes([call])
            (outcome,) = await call.future
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _enqueue(self, call: _Call) -> asyncio.Future[list[Outcome]]:
        """Queue a call's publishes for the next merge (see ``_merge_loop``)."""
        self._publishes.append(call)
        self._waiting += len(call.requests)
        if self._merger is None or self._merger.done():
            self._merger = asyncio.get_running_loop().create_task(self._merge_loop())
        self._publish_wakeup.set()
        return call.future

    async def _merge_loop(self) -> None:
        """Server-side group commit: a few publishes wait while the node is
        still persisting the previous proposals, so that they are merged
        into one append op per topic; once EAGER_PUBLISHES wait (a corked
        PublishBatch is that at once), they are validated right away, while
        the log write runs, and proposed for the next entry."""
        while True:
            await self._publish_wakeup.wait()
            self._publish_wakeup.clear()
            if self._waiting < EAGER_PUBLISHES:
                await self.node.proposals_taken()
            calls, self._publishes, self._waiting = self._publishes, [], 0
            if calls:
                try:
                    await self._propose_publishes(calls)
                except Exception as e:  # never leave a publish hanging
                    log.exception("merging publishes failed")
                    for call in calls:
                        call.settle_rest(e)

    async def _propose_publishes(self, calls: list[_Call]) -> None:
        if not self.node.is_leader:
            err = NotLeader(self.node.core.lead)
            for call in calls:
                call.settle_rest(err)
            return
        calls = _in_time(calls, _monotonic() + PROPOSE_MARGIN_S)
        t0 = time.perf_counter()
        requests = [r for c in calls for r in c.requests]
        owners = [(c, i) for c in calls for i in range(len(c.requests))]
        # Who sent each: the authenticated identity, where there is one.
        clients = [c.principal for c in calls for _ in c.requests]
        requests, owners, clients = self._open_produce_checked(requests, owners, clients)
        if self.node.group != 0:  # producer ids are group 0's: checked there first
            requests, owners, clients, topics = await self._producers_checked(
                requests, owners, clients
            )
            await self._topics_placed(topics)
        round_trace.mark("validate0")
        prepared, errors = await self._prepared(requests, clients)
        round_trace.mark("validate1")
        if self.node.group != 0:
            prepared, errors = await self._own_partitions(prepared, errors, requests, clients)
        _VALIDATE_SECONDS.observe(time.perf_counter() - t0)
        metrics.MERGED_PUBLISHES.observe(len(requests))
        for i, e in errors.items():
            call, pos = owners[i]
            call.settle(pos, e)
        for p in prepared:
            members = [owners[i] for i in p.members]
            deadlines = [c.deadline for c, _ in members if c.deadline is not None]
            # The node's future itself (a stub's coroutine wrapped): its
            # callback answers the spans in the turn after the apply.
            proposal = asyncio.ensure_future(
                self.node.propose_op(p.op, deadline=min(deadlines, default=None))
            )
            proposal.add_done_callback(functools.partial(_settle_spans, members))

    async def _topics_placed(self, names: set[str]) -> None:
        """Wait (``_placed``) until this data group placed each topic the
        publishes name: one made a moment ago may not be yet. A topic still
        missing after that is refused as NOT_FOUND by the validation."""
        for name in sorted(names - self._placed_topics):
            with contextlib.suppress(RoadlogError):
                await _placed(self.node, name, 0)
                self._placed_topics.add(name)  # a topic dropped later: NOT_FOUND

    async def _own_partitions(
        self,
        prepared: list[PreparedAppend],
        errors: dict[int, Exception],
        requests: list[bytes],
        clients: list[str],
    ) -> tuple[list[PreparedAppend], dict[int, Exception]]:
        """A data group takes only pings of its own partitions (a publish
        routed here by its group hint): a publish with a ping of another
        group's partition is refused (FAILED_PRECONDITION: the sender's map
        of the topic is stale), the others of its op prepared again."""
        own: list[PreparedAppend] = []
        again: list[int] = []  # positions of the publishes to prepare again
        for p in prepared:
            op = p.op.append
            groups = self.node.sm.topic(op.topic).partition_groups
            foreign = [
                i
                for i, part in enumerate(op.parts)
                if (int(groups[part.partition]) if groups else 0) != self.node.group
            ]
            if not foreign:
                own.append(p)
                continue
            for span, m in zip(op.spans, p.members, strict=True):
                if any(span.counts[i] for i in foreign):
                    errors[m] = RoadlogError(
                        Code.FAILED_PRECONDITION,
                        f"pings of topic {op.topic!r} in partitions outside group "
                        f"{self.node.group}: the topic's map changed, describe it again",
                    )
                else:
                    again.append(m)
        if again:
            redone, failed = await self._prepared(
                [requests[m] for m in again], [clients[m] for m in again]
            )
            own += [PreparedAppend(p.op, [again[i] for i in p.members]) for p in redone]
            errors.update({again[i]: e for i, e in failed.items()})
        return own, errors

    async def _producers_checked(
        self,
        requests: list[bytes],
        owners: list[tuple[_Call, int]],
        clients: list[str],
    ) -> tuple[list[bytes], list[tuple[_Call, int]], list[str], set[str]]:
        """A data group's publishes whose producer id group 0 (this node's
        replica of it) issued to their sender under their epoch; the others
        are answered here with the reason. A data group's leader judges them
        after a linearizable read of group 0 (one per round with a producer
        id in it, PRODUCER_CATCH_UP_S at most; UNAVAILABLE when it cannot be
        had): its replica of group 0 may lag the leader that issued an id,
        or that took one under its next epoch, a moment ago (a fenced
        instance's publish taken in a group the new epoch had not written to
        yet). Group 0's own leader judges on its state. Also returns the
        topics the publishes name."""
        meta = self.node.raft_groups.get(0)
        views: list[client_pb2.PublishRequestView | None] = []
        topics: set[str] = set()
        for raw in requests:
            try:
                view = client_pb2.PublishRequestView.FromString(raw)
            except DecodeError:
                views.append(None)  # prepare_appends answers it as malformed
                continue
            views.append(view)
            topics.add(view.topic)
        unsure: str | None = None  # why group 0 cannot be read now
        if meta is None:
            unsure = "this node runs no group 0 to check producer ids with"
        elif meta is not self.node and any(v is not None and v.producer_id for v in views):
            try:
                await asyncio.wait_for(meta.read_barrier(), PRODUCER_CATCH_UP_S)
            except (TimeoutError, NotLeader, RoadlogError) as e:
                unsure = f"group 0 cannot be read now ({e})"
        keep: list[int] = []
        for i, seen in enumerate(views):
            if seen is None or not seen.producer_id:
                keep.append(i)
                continue
            pid, epoch = seen.producer_id, seen.producer_epoch
            if meta is None or unsure is not None:
                refused: tuple[Code, str] | None = (
                    Code.UNAVAILABLE,
                    f"cannot tell now whether producer id {pid} may publish: {unsure}; try again",
                )
            else:
                refused = meta.sm.producer_refusal(pid, clients[i] or seen.client_id, epoch)
            if refused is None:
                keep.append(i)
            else:
                call, pos = owners[i]
                call.settle(pos, RoadlogError(*refused))
        kept = [requests[i] for i in keep], [owners[i] for i in keep], [clients[i] for i in keep]
        return (*kept, topics)

    def _open_produce_checked(
        self, requests: list[bytes], owners: list[tuple[_Call, int]], clients: list[str]
    ) -> tuple[list[bytes], list[tuple[_Call, int]], list[str]]:
        """The publishes whose sender may publish to their topic: a
        self-registered identity's to a topic closed to open produce are
        answered here, refused (``open_produce``); the topic is read from
        this node's replica of group 0. Costs nothing without such a sender."""
        if all(call.open_scopes is None for call, _ in owners):
            return requests, owners, clients
        meta = self.node if self.node.group == 0 else self.node.raft_groups.get(0)
        keep: list[int] = []
        for i, raw in enumerate(requests):
            call, pos = owners[i]
            if call.open_scopes is None:
                keep.append(i)
                continue
            refused: RoadlogError | None
            if meta is None:
                refused = RoadlogError(
                    Code.UNAVAILABLE, "this node runs no group 0 to check the topic with"
                )
            else:
                try:
                    name = client_pb2.PublishRequestView.FromString(raw).topic
                    refused = closed_to(meta.sm.topic(name), call.open_scopes)
                except (DecodeError, RoadlogError):
                    refused = None  # malformed, or no such topic: validation answers it
            if refused is None:
                keep.append(i)
            else:
                call.settle(pos, refused)
        return [requests[i] for i in keep], [owners[i] for i in keep], [clients[i] for i in keep]

    def _topic_lookup(self, name: str) -> tuple[int, Region]:
        topic = self.node.sm.topic(name)
        key = (topic.spec.name, topic.id)
        region = self._regions.get(key)
        if region is None:
            region = self._regions[key] = parse_region(topic.spec.region_geojson)
        return topic.spec.partitions, region

    async def create_topic(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.CreateTopicRequest.FromString(item.request)
        # Refuse bad specs before they enter the log; a region's parsing and
        # checks (up to geo.MAX_REGION_BYTES) run off the event loop.
        spec = await asyncio.get_running_loop().run_in_executor(self.cpu, normalized_spec, req.spec)
        op = command_pb2.CreateTopicOp(spec=spec, data_groups=self.node.cfg.placement_groups)
        return await self.node.propose_op(command_pb2.Op(create_topic=op))

    async def delete_topic(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.DeleteTopicRequest.FromString(item.request)
        self.node.sm.topic(req.name)  # NOT_FOUND before proposing
        return await self.node.propose_op(
            command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name=req.name))
        )

    async def init_producer(self, item: work_pb2.WorkItem) -> OpResult:
        """Issue a producer id chosen at random (63 bits): a publish can name
        only an id it was given, not guess the next one. A clash with an id
        issued meanwhile is refused by the state machine (ABORTED: ask again).
        An identity's quota (``producer_ids_per_identity``) is checked here,
        before proposing, and again where the op is applied (``max_held``),
        where the ones proposed beside it are counted too."""
        req = client_pb2.InitProducerRequest.FromString(item.request)
        if req.producer_id:  # an id the caller holds, kept under its next epoch
            renew = command_pb2.InitProducerOp(
                client_id=item.principal or req.client_id,
                producer_id=req.producer_id,
                bound=bool(item.principal),
                next_epoch=True,
            )
            return await self.node.propose_op(command_pb2.Op(init_producer=renew))
        limit = self.node.cfg.producer_ids_per_identity
        if item.principal:  # a quota per identity (an id unused for long is forgotten)
            # A fast refusal that costs no log entry; the apply checks again
            # (max_held), counting the ones proposed beside this one.
            held = self.node.sm.producer_ids_held(item.principal, limit)
            if held >= limit:
                raise quota_refusal(held)
        pid = secrets.randbits(63) or 1
        # Issued to an authenticated identity, the id is bound to it: only
        # its appends may name it (the state machine refuses the others'),
        # and it counts against that identity's quota.
        op = command_pb2.InitProducerOp(
            client_id=item.principal or req.client_id,
            producer_id=pid,
            bound=bool(item.principal),
            max_held=limit if item.principal else 0,
        )
        return await self.node.propose_op(command_pb2.Op(init_producer=op))

    async def join_group(self, item: work_pb2.WorkItem) -> OpResult:
        request = item.request
        if item.principal:  # the member is the identity's, whatever it declares
            req = client_pb2.JoinGroupRequest.FromString(request)
            try:
                g: groups_pb2.Group | None = self.node.sm.describe_group(req.group).group
            except RoadlogError:
                g = None  # none yet (the join makes it), or a bad name the join refuses
            if g is not None and g.topic != req.topic:
                # Another topic's group (the queue server checked req.topic):
                # refused as the apply would, before its members are looked at.
                raise name_taken(req.group, req.topic)
            if g is not None and req.member_id:
                self._own_member(g, req.member_id, item.principal)
            req.client_id = item.principal
            request = req.SerializeToString()
        return await self.groups.join(request, item.principal)

    async def heartbeat(self, item: work_pb2.WorkItem) -> OpResult:
        return await self._as_member(item, client_pb2.HeartbeatRequest, self.groups.heartbeat)

    async def commit_offsets(self, item: work_pb2.WorkItem) -> OpResult:
        return await self._as_member(item, client_pb2.CommitOffsetsRequest, self.groups.commit)

    async def leave_group(self, item: work_pb2.WorkItem) -> OpResult:
        return await self._as_member(item, client_pb2.LeaveGroupRequest, self.groups.leave)

    async def _as_member(
        self,
        item: work_pb2.WorkItem,
        request_type: type[_MemberRequest],
        op: Callable[[bytes], Awaitable[OpResult]],
    ) -> OpResult:
        """``op`` on the request, once an identity's call is known to come
        from the member it names (a call without a principal is a node's)."""
        if item.principal:
            req = request_type.FromString(item.request)
            g = readable_group(self.node.sm, item, req.group).group
            self._own_member(g, req.member_id, item.principal)
        return await op(item.request)

    @staticmethod
    def _own_member(g: groups_pb2.Group, member_id: str, principal: str) -> None:
        """PERMISSION_DENIED unless ``member_id`` of group ``g`` joined as
        ``principal`` (a member is its identity's alone: nobody else may
        heartbeat, commit or leave for it). A member that is not there is
        left to the call to refuse. Asked only once the caller may see the
        group (``group_access``)."""
        me = next((m for m in g.members if m.member_id == member_id), None)
        if me is not None and me.client_id != principal:
            raise RoadlogError(
                Code.PERMISSION_DENIED,
                f"member {member_id!r} of group {g.name!r} belongs to another client",
            )

    async def delete_group(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.DeleteGroupRequest.FromString(item.request)
        self.node.sm.describe_group(req.group)  # NOT_FOUND before proposing
        return await self.node.propose_op(
            command_pb2.Op(delete_group=command_pb2.DeleteGroupOp(group=req.group))
        )

    # ----------------------------------------------------------------- reads

    async def fetch(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.FetchRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        sm = self.node.sm
        group = self._data_group_of(req.topic, req.partition)
        if group:  # a placed topic: its pings are in that group's replica here
            sm = (await self._data_replica(group, req.topic, req.group_fences)).sm
        loop = asyncio.get_running_loop()
        resp = await loop.run_in_executor(self.cpu, sm.fetch, req)
        resp.served_by = str(self.node.id)
        # What this answer reflects, at most (the index applied once it was
        # read): a reader fenced on it is never shown an end before this one.
        if group:
            resp.group_fences.add(group=group, applied_index=sm.applied_index)
        else:
            resp.applied_index = sm.applied_index
        return OpResult(response=resp.SerializeToString())

    async def read_index(self, item: work_pb2.WorkItem) -> OpResult:
        """This group's commit index at its leader, for a ReadFences: a
        ReadIndex (the leader confirms with a heartbeat round that it still
        leads, Raft's section 6.4), within the item's deadline."""
        req = client_pb2.ReadIndexRequest.FromString(item.request)
        if req.group != self.node.group:
            raise RoadlogError(
                Code.UNAVAILABLE, f"group {self.node.group} was asked for group {req.group}"
            )
        if not self.node.is_leader:
            raise NotLeader(self.node.core.lead)
        try:
            index = await asyncio.wait_for(
                self.node.read_barrier(), max(item.budget_ms / 1000, 0.05)
            )
        except TimeoutError:
            raise RoadlogError(
                Code.UNAVAILABLE, f"group {req.group}'s read index was not confirmed in time"
            ) from None
        return OpResult(response=client_pb2.ReadIndexResponse(index=index).SerializeToString())

    async def describe_topic(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.DescribeTopicRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        d = self.node.sm.describe(req.name)
        await self._data_group_offsets([d], req.group_fences)
        return OpResult(response=d.SerializeToString())

    async def list_topics(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.ListTopicsRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        size = min(req.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        topics, token = self.node.sm.topics_page(req.page_token, size, PAGE_BYTES)
        await self._data_group_offsets(topics, req.group_fences)
        resp = client_pb2.ListTopicsResponse(topics=topics, next_page_token=token)
        return OpResult(response=resp.SerializeToString())

    def _data_group_of(self, topic: str, partition: int) -> int:
        """The data group holding a partition (0: this group's own state
        holds it: one group, a topic from before placement, or this is a
        data group)."""
        if self.node.group != 0 or self.node.sm.data_groups() == 1:
            return 0
        try:
            record = self.node.sm.topic(topic)
        except RoadlogError:
            return 0  # the state answers as it would (no topic)
        if partition >= record.spec.partitions:
            return 0
        return group_of(record, partition)

    async def _data_replica(
        self, group: int, topic: str, fences: Iterable[client_pb2.GroupFence]
    ) -> ReplicaView:
        """This node's replica of data group ``group`` once it applied the
        read's fence in that group and placed ``topic`` (up to
        PLACEMENT_WAIT_S, then UNAVAILABLE: another node may be further)."""
        node = self.node.raft_groups.get(group)
        if node is None:
            raise RoadlogError(Code.UNAVAILABLE, f"this node runs no group {group}")
        fence = max((f.applied_index for f in fences if f.group == group), default=0)
        try:
            await node.wait_applied(fence, PLACEMENT_WAIT_S)
        except TimeoutError:
            raise RoadlogError(
                Code.UNAVAILABLE,
                f"this node has not applied index {fence} of group {group} yet",
            ) from None
        await _placed(node, topic, self.node.sm.topic(topic).id)
        return node

    async def _data_group_offsets(
        self, topics: Iterable[topics_pb2.TopicDescription], fences: Iterable[client_pb2.GroupFence]
    ) -> None:
        """Fill the partitions of placed topics with their offsets as their
        data groups' replicas here hold them (fenced per group)."""
        fences = list(fences)
        for d in topics:
            groups = sorted({p.group for p in d.partitions if p.group})
            for g in groups:
                data = (await self._data_replica(g, d.topic.spec.name, fences)).sm
                held = {p.partition: p for p in data.describe(d.topic.spec.name).partitions}
                for p in d.partitions:
                    if p.group == g and p.partition in held:
                        src = held[p.partition]
                        p.first_offset, p.next_offset = src.first_offset, src.next_offset
                        p.last_append_ms = src.last_append_ms

    async def describe_group(self, item: work_pb2.WorkItem) -> OpResult:
        """The group, if the caller may read its topic (else NOT_FOUND, as
        for none: ``group_access``)."""
        req = client_pb2.DescribeGroupRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        d = readable_group(self.node.sm, item, req.group)
        return OpResult(response=d.SerializeToString())

    async def list_groups(self, item: work_pb2.WorkItem) -> OpResult:
        """The groups of the topics the caller may read (``group_access``)."""
        await self._fenced(item.fence)
        resp = client_pb2.ListGroupsResponse(groups=readable_groups(self.node.sm, item))
        return OpResult(response=resp.SerializeToString())

    async def get_heatmap(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.GetHeatmapRequest.FromString(item.request)
        if item.principal:  # give-to-get by who asks, never by a client id it declares
            req.client_id = item.principal
        await self._fenced(max(item.fence, req.min_applied_index))
        # Give-to-get on the log's clock, the one contributions are stamped
        # with (a stepped wall clock here or at a leader must not refuse a
        # fresh contributor); the wall clock only before anything was applied.
        sm = self.node.sm
        elsewhere = await self._contribution_in_groups(req)
        resp = sm.heatmap(req, sm.log_ms or int(time.time() * 1000), elsewhere)
        return OpResult(response=resp.SerializeToString())

    async def _contribution_in_groups(
        self, req: client_pb2.GetHeatmapRequest
    ) -> list[Contribution | None] | None:
        """A topic placed in data groups: the client's runs of appends as
        they recorded them (their replicas here, each once it applied the
        request's fence in that group). None: the topic is group 0's."""
        if self.node.group != 0 or self.node.sm.data_groups() == 1:
            return None
        try:
            record = self.node.sm.topic(req.topic)
        except RoadlogError:
            return None  # the state answers as it would (no topic)
        runs: list[Contribution | None] = []
        for g in sorted(set(record.partition_groups)):
            data = await self._data_replica(g, req.topic, req.group_fences)
            runs.append(data.sm.contribution(req.topic, req.client_id))
        return runs

    async def put_heatmap(self, item: work_pb2.WorkItem) -> OpResult:
        req = client_pb2.PutHeatmapRequest.FromString(item.request)
        return await self.node.propose_op(
            command_pb2.Op(put_heatmap=command_pb2.PutHeatmapOp(request=req))
        )
