"""The node's link to one queue server: a long-lived Pull stream (the
framed Work link where the queue server offers one, else gRPC) that takes
work items, hands them to the handlers (``routing``), and answers with their
results and what routing needs of this node (role, term, indexes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping

import grpc

from node_daemon.replica.replica import Replica
from node_daemon.replica.status import group_figures, node_status
from node_daemon.work.routing import Executor, data_group_states
from roadlog import round_trace
from roadlog.limits import WORK_BATCH_BYTES, WORK_MESSAGE_BYTES, grpc_options
from roadlog.runtime import frames, tls
from roadlog.runtime.auth import token_metadata
from roadlog.v1 import raft_pb2, work_pb2, work_pb2_grpc

log = logging.getLogger("roadlog.worker")

WRITE_CREDIT = 256
READ_CREDIT = 64

# How often at most a node tells a queue server its indexes: while fenced
# reads need them there (FenceWait: they wait for an index this node has not
# told, or came in lately; always for a queue server that never says), and
# otherwise (then with its full NodeStatus, which rides on a message at most
# that often). Role and leader moves go at once; the indexes ride on every
# result.
INDEX_EVERY_S = 0.005
INDEX_IDLE_S = 0.1

# When a queue-server link last told what (a module attribute: tests
# replace it to drive the telling periods without real time passing).
_clock = time.monotonic


# A node's role as told to a queue server: leads group 0, its leader, term,
# the leader's address, and (group, leads it, term) of each data group.
_Role = tuple[bool, int, int, str, tuple[tuple[int, bool, int], ...]]


# In the outbox: the results gathered so far (``_Answers``) go here, as
# messages built when the link's writer takes them.
_ANSWERS = work_pb2.WorkerMessage()


class _Answers:
    """Results of one turn of the loop, not yet told (``_answer``)."""

    __slots__ = ("due", "reads", "results", "writes")

    def __init__(self) -> None:
        self.results: list[work_pb2.WorkResult] = []
        self.writes = 0
        self.reads = 0
        self.due = False  # ``_ANSWERS`` is in the outbox for them


class QueueServerLink:
    """One long-lived Pull stream to one queue server, re-opened when it breaks.

    What it tells the queue server about this node: the role, leader and
    term at once when they move (with the full NodeStatus); the applied and
    commit indexes with every result, promptly (every INDEX_EVERY_S at most,
    at once when it reaches the fence) while the queue server holds reads
    waiting for an index this node has not told or fenced reads came in
    there lately (``FenceWait``), and otherwise every INDEX_IDLE_S at most,
    with the full status (which is built only for the messages that carry
    it). A queue server that never sends ``FenceWait`` (an older one) is
    told every index move promptly."""

    def __init__(
        self,
        address: str,
        node: Replica,
        executor: Executor,
        token: str,
        secret: bytes | None = None,
        data_groups: Mapping[int, Replica] | None = None,
        data_groups_only: bool = False,
    ) -> None:
        """``data_groups_only``: a worker process's link, for its data groups
        alone (``node`` is one of them, for the node's id and config)."""
        self.address = address
        self.node = node
        self.data_groups_only = data_groups_only
        self.executor = executor
        self.data_groups = data_groups if data_groups is not None else {}  # told with its state
        self.token = token
        self.secret = secret  # dial the framed Work link where offered (None: gRPC only)
        self.link_kind = ""  # "frames" or "grpc" while connected
        self.outbox: asyncio.Queue[work_pb2.WorkerMessage] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.connected = False
        self._told: _Role | None = None  # the role it last told
        self._told_group_applied: dict[int, int] = {}  # each data group's, last told
        self._told_applied = 0  # the indexes it last told
        self._told_commit = 0
        self._told_at = 0.0  # when it last told a state
        self._status_at = float("-inf")  # when it last told a full status
        self._index_timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self._fences_told = False  # the queue server sends FenceWait (on this stream)
        self._fence_wait = 0  # reads there wait for this applied index
        self._fence_reads = False  # fenced reads come in there lately
        self._answers = _Answers()  # results not yet in a message (``_answer``)
        self._backlog: deque[work_pb2.WorkerMessage] = deque()  # built, not yet taken

    def state(self, with_status: bool = True) -> work_pb2.WorkerState:
        """What routing needs (role, term, indexes), and unless told not to
        (the state riding on every result) the node's full status."""
        n = self.node
        if self.data_groups_only:
            return work_pb2.WorkerState(
                node_id=n.id,
                address=n.cfg.address,
                data_groups_only=True,
                groups=data_group_states(self.data_groups),
            )
        f = group_figures(n)
        st = work_pb2.WorkerState(
            node_id=n.id,
            address=n.cfg.address,
            is_leader=f.is_leader,
            leader=f.leader,
            term=f.term,
            applied_index=f.applied_index,
            commit_index=f.commit_index,
            leader_address=n.address_of(f.leader),
        )
        if self.data_groups:
            st.groups.extend(data_group_states(self.data_groups))
        if with_status:
            st.status.CopyFrom(node_status(n, f))
        return st

    def _role(self) -> _Role:
        n = self.node
        groups = tuple((g, d.is_leader, d.core.term) for g, d in sorted(self.data_groups.items()))
        if self.data_groups_only:
            return (False, 0, 0, "", groups)
        lead = n.core.lead
        return (n.is_leader, lead, n.core.term, n.address_of(lead), groups)

    def state_changed(self) -> None:
        """The node's role or indexes moved: tell the queue server now, later
        (a timer) or not at all yet (see the class docstring)."""
        if not self.connected:
            return
        if self._role() != self._told:
            self._tell_state(with_status=True)
        else:
            self._indexes_moved()

    def fence_wait(self, index: int, reads: bool) -> None:
        """The queue server's FenceWait: reads there wait for ``index`` (0:
        none does); fenced reads come in there lately (``reads``)."""
        self._fences_told = True
        self._fence_wait = index
        if reads != self._fence_reads:
            self._fence_reads = reads
            self.executor.reads_flowing(self, reads)
        if self.connected and (reads or index > self._told_applied):
            self._indexes_moved()

    def fence_wait_ended(self) -> None:
        """The stream broke or starts over: no word from the queue server."""
        if self._fence_reads:
            self._fence_reads = False
            self.executor.reads_flowing(self, False)

    def _prompt(self) -> bool:
        """Tell index moves promptly (see the class docstring)."""
        return not self._fences_told or self._fence_reads or self._fence_wait > self._told_applied

    def _indexes_moved(self) -> None:
        n = self.node
        if self.data_groups_only:  # group 0's fields stay unset
            applied = committed = 0
        else:
            applied, committed = n.sm.applied_index, n.core.log.committed
        moved = applied > self._told_applied or committed > self._told_commit
        moved = moved or any(
            d.sm.applied_index > self._told_group_applied.get(g, 0)
            for g, d in self.data_groups.items()
        )
        if moved and self._prompt():
            if self._told_applied < self._fence_wait <= applied:
                self._tell_state()  # reads wait for just this: at once
                return
            due = self._told_at + INDEX_EVERY_S
        else:
            # Now and then, with the full status: indexes no read waits for,
            # and whatever else moved (a member added, ready again).
            due = self._status_at + INDEX_IDLE_S
        now = _clock()
        if due <= now:
            self._tell_state()
        elif self._index_timer is None or due < self._timer_due:
            if self._index_timer is not None:
                self._index_timer.cancel()
            self._timer_due = due
            self._index_timer = asyncio.get_running_loop().call_later(due - now, self._tell_indexes)

    def _tell_indexes(self) -> None:
        self._index_timer = None
        if self.connected:
            self._tell_state()

    def _tell_state(self, with_status: bool = False) -> None:
        """A state message; it carries the full status when asked to, or when
        the last one told is INDEX_IDLE_S old."""
        if self._index_timer is not None:
            self._index_timer.cancel()
            self._index_timer = None
        with_status = with_status or _clock() - self._status_at >= INDEX_IDLE_S
        self._tell(work_pb2.WorkerMessage(state=self.state(with_status)))

    def _tell(self, msg: work_pb2.WorkerMessage) -> None:
        if msg.HasField("state"):
            self._told_state(msg.state)
        self.outbox.put_nowait(msg)

    def _told_state(self, s: work_pb2.WorkerState) -> None:
        groups = tuple((g.group, g.is_leader, g.term) for g in s.groups)
        self._told = (s.is_leader, s.leader, s.term, s.leader_address, groups)
        self._told_group_applied = {g.group: g.applied_index for g in s.groups}
        self._told_applied = s.applied_index
        self._told_commit = s.commit_index
        self._told_at = _clock()
        if s.HasField("status"):
            self._status_at = self._told_at

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _messages(self) -> AsyncIterator[work_pb2.WorkerMessage]:
        first = work_pb2.WorkerMessage(
            state=self.state(), credit=work_pb2.Credit(writes=WRITE_CREDIT, reads=READ_CREDIT)
        )
        self._told_state(first.state)  # a new stream's first word
        yield first
        carried: work_pb2.WorkerMessage | None = None  # did not fit the last message
        while True:
            msg = carried if carried is not None else await self._next()
            carried = None
            size = msg.ByteSize()
            # Merge what piled up into one message, up to WORK_BATCH_BYTES of
            # results (a bigger result goes alone).
            while (more := self._next_nowait()) is not None:
                extra = sum(len(r.response) for r in more.results)
                if extra and size + extra > WORK_BATCH_BYTES:
                    carried = more
                    break
                if more.HasField("state"):
                    status = msg.state.status if msg.state.HasField("status") else None
                    msg.state.CopyFrom(more.state)
                    if status is not None and not more.state.HasField("status"):
                        msg.state.status.CopyFrom(status)  # the newest status stays
                msg.credit.writes += more.credit.writes
                msg.credit.reads += more.credit.reads
                msg.results.extend(more.results)
                size += extra
            yield msg

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            inflight: set[asyncio.Task[None]] = set()
            try:
                opts = grpc_options(WORK_MESSAGE_BYTES)
                async with tls.current().channel(self.address, options=opts) as ch:
                    stub = work_pb2_grpc.WorkStub(ch)
                    self.outbox = asyncio.Queue()
                    self._answers, self._backlog = _Answers(), deque()  # the old stream's
                    self._fences_told, self._fence_wait = False, 0  # until this server says
                    self.fence_wait_ended()
                    port = await self._frames_port(stub)
                    if port:
                        await self._pull_frames(port, inflight)
                    else:
                        call = stub.Pull(self._messages(), metadata=token_metadata(self.token))
                        self._up("grpc")
                        async for batch in call:
                            self._take(batch, inflight)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.debug("work stream broke", extra={"queue": self.address, "code": e.code().name})
            except OSError as e:  # ConnectionError and TimeoutError too
                log.debug("work link broke", extra={"queue": self.address, "error": repr(e)})
            except Exception:
                log.exception("work stream failed", extra={"queue": self.address})
            finally:
                if self.connected:
                    backoff = 0.05  # it was working: retry soon
                self.connected, self.link_kind = False, ""
                self.fence_wait_ended()
                if self._index_timer is not None:
                    self._index_timer.cancel()
                    self._index_timer = None
                for t in inflight:
                    t.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _up(self, kind: str) -> None:
        self.connected, self.link_kind = True, kind
        log.info("work link up", extra={"queue": self.address, "link": kind})

    async def _frames_port(self, stub: work_pb2_grpc.WorkAsyncStub) -> int:
        """The queue server's framed Work link port (0: it offers none)."""
        if self.secret is None:
            return 0
        try:
            reply = await stub.FramesEndpoint(
                raft_pb2.FramesEndpointRequest(cluster=self.node.cfg.cluster_name),
                metadata=token_metadata(self.token),
                wait_for_ready=True,
                timeout=10.0,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0  # a queue server of an older version: gRPC Pull
            raise
        return int(reply.port)

    async def _pull_frames(self, port: int, inflight: set[asyncio.Task[None]]) -> None:
        """Work over the framed link until it breaks (then raises)."""
        assert self.secret is not None
        host = self.address.rpartition(":")[0].strip("[]")

        def receive(data: bytes) -> None:
            round_trace.mark("work_in")
            self._take(work_pb2.WorkItems.FromString(data), inflight)

        conn = await frames.connect(
            frames.WORK,
            host,
            port,
            self.node.cfg.cluster_name,
            self.secret,
            self.node.id,
            receive,
        )
        self._up("frames")
        writer = asyncio.get_running_loop().create_task(self._send_frames(conn))
        lost = asyncio.ensure_future(conn.wait_closed())
        try:
            await asyncio.wait({writer, lost}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done():
                writer.result()  # its error, if any
            raise ConnectionError("work frames link is down")
        finally:
            writer.cancel()
            lost.cancel()
            conn.abort()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    async def _send_frames(self, conn: frames.ClientConn) -> None:
        async for msg in self._messages():
            round_trace.mark("answer_out")
            await conn.send(msg.SerializeToString())

    def _take(self, batch: work_pb2.WorkItems, inflight: set[asyncio.Task[None]]) -> None:
        """Work from the queue server: each item runs as its own task."""
        if batch.HasField("fence_wait"):
            fw = batch.fence_wait
            self.fence_wait(fw.index, fw.reads)
        loop = asyncio.get_running_loop()
        for it in batch.items:
            t = loop.create_task(self._do(it))
            inflight.add(t)
            t.add_done_callback(inflight.discard)

    async def _do(self, item: work_pb2.WorkItem) -> None:
        res = await self.executor.run(item)
        round_trace.mark("result")
        self._answer(res, item.kind)

    def _answer(self, res: work_pb2.WorkResult, kind: int) -> None:
        """Queue one item's result: the results that come before the link's
        writer takes them leave together (``_answers_out``), every group's
        of this process, with one state."""
        answers = self._answers
        answers.results.append(res)
        if kind == work_pb2.WORK_KIND_WRITE:
            answers.writes += 1
        elif kind == work_pb2.WORK_KIND_READ:
            answers.reads += 1
        if not answers.due:
            answers.due = True
            self.outbox.put_nowait(_ANSWERS)

    async def _next(self) -> work_pb2.WorkerMessage:
        """The next message for the queue server (waits for one)."""
        while not self._backlog:
            msg = await self.outbox.get()
            if msg is not _ANSWERS:
                return msg
            self._answers_out()
        return self._backlog.popleft()

    def _next_nowait(self) -> work_pb2.WorkerMessage | None:
        """The next message for the queue server, if one is there."""
        while not self._backlog:
            if self.outbox.empty():
                return None
            msg = self.outbox.get_nowait()
            if msg is not _ANSWERS:
                return msg
            self._answers_out()
        return self._backlog.popleft()

    def _answers_out(self) -> None:
        """The results gathered as WorkerMessages (into ``_backlog``) of up
        to WORK_BATCH_BYTES of responses each (a bigger one alone), with
        the credit their items give back and the state: a read fenced at
        one of these writes' indexes can be handed to this node as soon as
        its answer arrives."""
        answers, self._answers = self._answers, _Answers()
        if not answers.results:
            return
        state = self.state(False)
        self._told_state(state)
        msgs: list[work_pb2.WorkerMessage] = []
        size = 0
        for res in answers.results:
            n = len(res.response)
            if not msgs or (size and size + n > WORK_BATCH_BYTES):
                msgs.append(work_pb2.WorkerMessage())
                size = 0
            msgs[-1].results.append(res)
            size += n
        msgs[0].credit.writes, msgs[0].credit.reads = answers.writes, answers.reads
        for msg in msgs:
            msg.state.CopyFrom(state)
        self._backlog.extend(msgs)
