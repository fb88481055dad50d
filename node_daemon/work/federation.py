"""The node's side of a directory (issue 43, docs/federation.md): members
registered, their loads, topics placed and looked up, in group 0's state
(``node_daemon/state/federation.py``). Part of ``WorkHandler`` (a mixin:
its methods are the work items' handlers, ``roadlog.rpc``).

Writes are checked here first where that needs no state (a bad name costs
no log entry) and decided where applied; reads are fenced like every read.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from node_daemon.replica.replica import Replica
from node_daemon.state.federation import check_member_name, check_tags
from node_daemon.state.responses import OpResult
from roadlog.v1 import command_pb2, federation_pb2, work_pb2


class FederationWork:
    """The directory's handlers of ``WorkHandler``."""

    node: Replica

    if TYPE_CHECKING:  # IdentityWork's, shared in WorkHandler

        async def _fenced(self, fence: int) -> None: ...

    async def register_member(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.RegisterMemberRequest.FromString(item.request)
        check_member_name(req.member.name)
        check_tags(req.member.tags)
        op = command_pb2.RegisterMemberOp(member=req.member)
        return await self.node.propose_op(command_pb2.Op(register_member=op))

    async def report_load(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.ReportLoadRequest.FromString(item.request)
        return await self.node.propose_op(
            command_pb2.Op(report_load=command_pb2.ReportLoadOp(request=req))
        )

    async def place_topic(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.PlaceTopicRequest.FromString(item.request)
        check_tags(req.tags)
        return await self.node.propose_op(
            command_pb2.Op(place_topic_home=command_pb2.PlaceTopicHomeOp(request=req))
        )

    async def forget_topic_home(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.ForgetTopicHomeRequest.FromString(item.request)
        return await self.node.propose_op(
            command_pb2.Op(forget_topic_home=command_pb2.ForgetTopicHomeOp(request=req))
        )

    async def lookup_topic(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.LookupTopicRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        home = self.node.sm.read_federation(lambda txn, fed: fed.home(txn, req.topic))
        home.applied_index = self.node.sm.applied_index
        return OpResult(response=home.SerializeToString())

    async def get_federation(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.GetFederationRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        now_ms = int(time.time() * 1000)
        fed = self.node.sm.read_federation(lambda txn, table: table.federation(txn, now_ms))
        fed.applied_index = self.node.sm.applied_index
        return OpResult(response=fed.SerializeToString())

    # --------------------------------------------- topic moves (a member's)

    async def fence_topic(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.FenceTopicRequest.FromString(item.request)
        return await self.node.propose_op(
            command_pb2.Op(fence_topic=command_pb2.FenceTopicOp(request=req))
        )

    async def import_topic(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.ImportTopicRequest.FromString(item.request)
        return await self.node.propose_op(
            command_pb2.Op(import_topic=command_pb2.ImportTopicOp(request=req))
        )

    async def export_topic_state(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.ExportTopicStateRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        out = self.node.sm.export_topic_state(req.topic)
        out.applied_index = self.node.sm.applied_index
        return OpResult(response=out.SerializeToString())

    async def move_topic_home(self, item: work_pb2.WorkItem) -> OpResult:
        req = federation_pb2.MoveTopicHomeRequest.FromString(item.request)
        check_member_name(req.target)
        return await self.node.propose_op(
            command_pb2.Op(move_topic_home=command_pb2.MoveTopicHomeOp(request=req))
        )
