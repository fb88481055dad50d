"""Bulk reads straight from this node's state machines (the Spark data
source's path): plan offset ranges for an append-time window, then stream a
range batch by batch. Only committed (applied) data is ever read, and a
plan's ranges are pinned, so reading a plan twice gives the same pings.

A topic placed in data groups has each partition's batches in its group's
state machine (every node runs every group): a range names its group and
is fenced by that group's applied index; the topic itself is group 0's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from node_daemon.replica.replica import Replica
from node_daemon.state.machine import StateMachine
from roadlog import column_subset
from roadlog.errors import Code, RoadlogError
from roadlog.grpc_status import to_grpc
from roadlog.placement import group_of
from roadlog.v1 import noderead_pb2, noderead_pb2_grpc

FENCE_WAIT_S = 30.0


class NodeReadService(noderead_pb2_grpc.NodeReadServicer):
    def __init__(self, node: Replica, token: str) -> None:
        self.node = node
        self.token = token

    async def _prepare(self, context: Any, fence: int, group: int = 0) -> StateMachine:
        """The state of ``group``'s replica here, once it applied ``fence``
        (a group another process of this node runs: read-only, as it is
        then; it applied ``fence``)."""
        node = self.node.raft_groups.get(group)
        if node is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this node runs no Raft group {group}")
        assert node is not None
        try:
            if node.sm.applied_index < fence:
                await node.wait_applied(fence, timeout=FENCE_WAIT_S)
            return node.sm
        except (TimeoutError, RoadlogError):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this node has not applied index {fence} of group {group} yet",
            )
            raise  # abort raises; for the type checker

    async def Plan(self, request: Any, context: Any) -> noderead_pb2.PlanResponse:
        """The ranges of a window's pings, partition by partition, once this
        node applied the plan's fences (group 0's and each data group's):
        a node still catching up answers UNAVAILABLE, and the planner asks
        the next."""
        await self._prepare(context, request.min_applied_index)
        for f in request.group_fences:
            await self._prepare(context, f.applied_index, f.group)
        sm = self.node.sm
        loop = asyncio.get_running_loop()

        groups = self.node.raft_groups

        def plan() -> noderead_pb2.PlanResponse:
            topic = sm.topic(request.topic)
            resp = noderead_pb2.PlanResponse(topic=topic)
            placed = sorted(set(topic.partition_groups))
            for g in placed:
                if g not in groups:
                    raise RoadlogError(Code.UNAVAILABLE, f"this node runs no Raft group {g}")
            ranges = []
            for p in range(topic.spec.partitions):
                g = group_of(topic, p)
                try:
                    lo, hi = groups[g].sm.offsets_for_window(
                        request.topic, p, request.append_start_ms, request.append_end_ms
                    )
                except RoadlogError as e:
                    if g and e.code == Code.NOT_FOUND:
                        continue  # not placed in its group yet: nothing appended there
                    raise
                if hi > lo:
                    ranges.append((p, lo, hi, g))
            # Each group's fence is read after its ranges: a node that applied
            # it holds every batch they name (applied indexes only grow).
            fences = {0: sm.applied_index, **{g: groups[g].sm.applied_index for g in placed}}
            resp.applied_index = fences[0]
            for g in placed:
                resp.group_applied[g] = fences[g]
            for p, lo, hi, g in ranges:
                resp.ranges.add(
                    partition=p, start_offset=lo, end_offset=hi, group=g, applied_index=fences[g]
                )
            return resp

        try:
            resp = await loop.run_in_executor(None, plan)
        except RoadlogError as e:
            await context.abort(to_grpc(e.code), e.message)
        conf = self.node.core.conf
        addrs = self.node.addresses
        resp.node_addresses.extend(
            sorted({addrs[n] for n in conf.voters | conf.learners if n in addrs})
            or [self.node.cfg.address]
        )
        return resp

    async def ReadRange(self, request: Any, context: Any) -> AsyncIterator[noderead_pb2.RangeBatch]:
        """A range's batches, each whole as stored, or with ``columns``
        only those columns of it (``column_subset.prune``, in the executor
        with the read)."""
        try:
            fields = column_subset.fields_for(request.columns) if request.columns else None
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        sm = await self._prepare(context, request.min_applied_index, request.group)
        loop = asyncio.get_running_loop()
        offset, end = request.start_offset, request.end_offset
        topic, partition = request.topic, request.partition

        def read(at: int) -> tuple[list[noderead_pb2.RangeBatch], int]:
            batches, nxt = sm.read_range(topic, partition, at, end)
            out = []
            for b in batches:
                if fields is None:
                    rb = noderead_pb2.RangeBatch(
                        base_offset=b.base_offset, append_ms=b.append_ms, batch=b.batch
                    )
                else:
                    cols, ids, n = column_subset.prune(b.batch, fields)
                    rb = noderead_pb2.RangeBatch(
                        base_offset=b.base_offset, append_ms=b.append_ms, batch=cols,
                        count=n, device_ids=ids,
                    )  # fmt: skip
                out.append(rb)
            return out, nxt

        while offset < end:
            try:
                batches, offset = await loop.run_in_executor(None, read, offset)
            except RoadlogError as e:
                await context.abort(to_grpc(e.code), e.message)
            for rb in batches:
                yield rb
