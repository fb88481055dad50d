"""The node's Admin service (membership changes, leadership transfer,
snapshots, leaving, status and state digests) and what of it only the
cluster's own processes may call."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter

from node_daemon.raft import ConfChange, ConfChangeType
from node_daemon.replica.replica import NotLeader, Replica
from node_daemon.replica.status import node_status
from node_daemon.store.cluster_membership import Membership
from node_daemon.store.leader_balance import successor
from node_daemon.work.handler import propose_client
from roadlog.errors import Code, RoadlogError
from roadlog.grpc_status import to_grpc
from roadlog.runtime.auth import protects
from roadlog.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    client_pb2,
    clients_pb2,
    command_pb2,
)

log = logging.getLogger("roadlog.node")


# With TLS (issue 19, finding 4): the token is no peer credential. Raft
# traffic and node reads are let in by the caller's certificate alone
# (``node_callers``); the changing admin calls need a node's certificate,
# or an operator's client certificate and the cluster token.
NODE_CHANGES = protects(
    (),
    [
        f"/roadlog.v1.Admin/{m}"
        for m in ("AddNode", "RemoveNode", "TransferLeader", "Snapshot", "Leave", "CreateClient")
    ],
)

# Without TLS (debugging only): what only the cluster's own processes may
# call (ClusterAuth checks the token).
NODE_PROTECTED = protects(
    ("roadlog.v1.RaftPeer", "roadlog.v1.NodeRead"),
    [
        f"/roadlog.v1.Admin/{m}"
        for m in ("AddNode", "RemoveNode", "TransferLeader", "Snapshot", "Leave", "CreateClient")
    ],
)


# With TLS the node's port is mutual: every caller holds a certificate of the
# cluster's CA. Raft traffic only from nodes; the changing admin calls and
# node reads from nodes and clients (operators' tools, the Spark reader);
# status, health and reflection from any holder.
_CHANGING = {
    f"/roadlog.v1.Admin/{m}"
    for m in ("AddNode", "RemoveNode", "TransferLeader", "Snapshot", "Leave", "CreateClient")
}
_CERT_REFUSED = Counter(
    "roadlog_node_cert_refused_total",
    "calls to a node refused for the caller's certificate (none, or a kind not allowed)",
    ["method"],
)


def node_callers(method: str) -> tuple[str, ...] | None:
    """The certificate kinds that may call ``method`` on a node (None: any)."""
    if method.startswith("/roadlog.v1.RaftPeer/"):
        return ("node",)
    if method in _CHANGING or method.startswith("/roadlog.v1.NodeRead/"):
        return ("node", "client")
    return None


def refused_by_cert(method: str) -> None:
    _CERT_REFUSED.labels(method).inc()


class AdminService(admin_pb2_grpc.AdminServicer):
    """Operators' calls. Changing calls need the cluster's credentials."""

    def __init__(
        self, node: Replica, membership: Membership, token: str, stop: asyncio.Event
    ) -> None:
        self.node = node
        self.membership = membership
        self.token = token
        self.stop = stop
        # Hands the groups this node's worker processes lead to a node (0:
        # each to its best follower); None: every group runs in this process.
        self.remote_hand_over: Callable[[int], Awaitable[None]] | None = None

    async def Status(self, request: Any, context: Any) -> client_pb2.ClusterStatus:
        n = self.node
        ns = node_status(n)
        st = client_pb2.ClusterStatus(leader=ns.leader, term=ns.term)
        st.nodes.append(ns)
        for m in self.membership.members():  # the others: where to ask them
            if m.node_id != n.id:
                st.nodes.add(id=m.node_id, address=m.address)
        return st

    async def _admin(self, context: Any, coro: Any) -> admin_pb2.AdminResponse:
        try:
            index = await coro
        except NotLeader as e:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{e}; the leader is node {e.leader} ({self.node.address_of(e.leader)})",
            )
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "not applied in time")
        return admin_pb2.AdminResponse(ok=True, index=index or 0)

    async def AddNode(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        if request.node_id <= 0 or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "need node_id and address")
        return await self._admin(
            context, self._add(request.node_id, request.address, request.as_voter)
        )

    async def _add(self, node_id: int, address: str, as_voter: bool) -> int:
        """Record the address through the log, then add the node (a node
        already in the configuration only gets its address updated). Only
        the leader answers: a follower's configuration may be stale (a node
        removed a moment ago is still a voter in its own), and "already a
        member" from it would acknowledge an addition that never happens
        (found by the nemesis: a removed node re-added, acknowledged, and
        left out for good)."""
        n = self.node
        if not n.is_leader:
            raise NotLeader(n.core.lead)
        n.update_addresses({node_id: address})
        if n.sm.peers().get(node_id) != address:
            op = command_pb2.Op(add_peer=command_pb2.AddPeerOp(node_id=node_id, address=address))
            res = await n.propose_op(op)
            if res.code != Code.OK:
                raise NotLeader(n.core.lead, res.message)
        conf = n.core.conf
        if node_id in conf.voters or (node_id in conf.learners and not as_voter):
            # Already a member in the leader's latest configuration: answered
            # once the entry that made it one is applied (committed).
            await n.wait_applied(n.core.conf_history[-1][0], timeout=30)
            if not n.is_leader:
                raise NotLeader(n.core.lead)
            return n.sm.applied_index
        kind = ConfChangeType.ADD_VOTER if as_voter else ConfChangeType.ADD_LEARNER
        log.info("adding a node", extra={"node": node_id, "address": address, "voter": as_voter})
        return await n.conf_change(ConfChange(kind, node_id))

    async def RemoveNode(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        cc = ConfChange(ConfChangeType.REMOVE_NODE, request.node_id)
        return await self._admin(context, self.node.conf_change(cc))

    async def TransferLeader(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        resp = await self._admin(context, self.node.transfer_leader(request.node_id))
        if request.all_groups:
            await self._hand_data_groups(request.node_id)
            if self.remote_hand_over is not None:  # the groups worker processes run
                await self.remote_hand_over(request.node_id)
        return resp

    async def _hand_data_groups(self, target: int) -> None:
        """Every data group this node leads to ``target`` where it is a voter
        of the group, else to the group's best follower (none: it stays)."""
        for g, n in sorted(self.node.raft_groups.items()):
            if g == 0 or not n.is_leader or not isinstance(n, Replica):
                continue  # a group another process runs: handed over there
            to = target if target in n.core.conf.voters and target != n.id else successor(n.core)
            if to:
                with contextlib.suppress(NotLeader):
                    await n.transfer_leader(to)

    async def Snapshot(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        return await self._admin(context, self.node.snapshot_now())

    async def Leave(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        resp = await self._admin(context, self.membership.leave())
        log.info("left the cluster: stopping", extra={"index": resp.index})
        asyncio.get_running_loop().call_later(0.5, self.stop.set)
        return resp

    async def StateDigest(self, request: Any, context: Any) -> admin_pb2.StateDigestResponse:
        loop = asyncio.get_running_loop()
        sm = self.node.sm
        # The index from the digest's own transaction (nemesis finding 7).
        index, digest = await loop.run_in_executor(self.node._apply_io, sm.indexed_digest)
        return admin_pb2.StateDigestResponse(applied_index=index, sha256=digest)

    async def CreateClient(
        self, request: clients_pb2.CreateClientRequest, context: Any
    ) -> clients_pb2.CreateClientResponse:
        """A client identity (the first admin's, say: ``roadlog cluster up``
        and ``roadlog client bootstrap`` call this with the cluster's
        credentials). The caller made the token and sends its hash."""
        try:
            res = await propose_client(
                self.node, request.name, list(request.scopes), request.token_hash
            )
        except NotLeader as e:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{e}; the leader is node {e.leader} ({self.node.address_of(e.leader)})",
            )
        except RoadlogError as e:
            await context.abort(to_grpc(e.code), e.message)
        if res.code != Code.OK:
            await context.abort(to_grpc(res.code), res.message)
        return clients_pb2.CreateClientResponse.FromString(res.response)
