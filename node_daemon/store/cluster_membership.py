"""Growing, healing and leaving a cluster, one configuration change at a time.

On the leader, every ``STEP_S``:

- the replicated address book gets every member's current address (with
  discovery; a static peer list is the address book);
- a learner that has caught up is promoted to voter while the cluster has
  fewer than ``target_voters``;
- a voter silent for ``dead_voter_timeout_s`` is replaced: a caught-up
  learner is promoted first, and only then, with more voters than the
  target, is the dead voter removed; so the voters never drop below the
  configured number (and never below a majority of them).

On a node that is not in any configuration yet (a newcomer found by
discovery), ``join`` asks the leader to add it as a learner until it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from discovery.core import Join
from discovery.protocol import Member
from node_daemon.raft import ConfChange, ConfChangeType, Role
from node_daemon.replica.replica import NotLeader, Replica
from roadlog.runtime import tls
from roadlog.runtime.auth import token_metadata
from roadlog.v1 import admin_pb2, admin_pb2_grpc, command_pb2

log = logging.getLogger("roadlog.membership")

STEP_S = 0.5
CATCH_UP_LAG = 64  # a learner within this many entries of the leader is caught up


class Membership:
    def __init__(self, node: Replica, token: str, sync_addresses: bool = True) -> None:
        self.node = node
        self.token = token
        self.sync_addresses = sync_addresses  # off for a static peer list
        self.leaving = False  # once leaving, never ask to be added again
        self._leader_since = 0.0
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ views

    def in_config(self) -> bool:
        conf = self.node.core.conf
        return self.node.id in conf.voters or self.node.id in conf.learners

    def members(self) -> tuple[Member, ...]:
        conf = self.node.core.conf
        addr = self.node.addresses
        return tuple(
            Member(n, addr.get(n, ""), n in conf.voters)
            for n in sorted(conf.voters | conf.learners)
        )

    def caught_up(self, node_id: int) -> bool:
        pr = self.node.core.prs.get(node_id)
        return pr is not None and pr.match + CATCH_UP_LAG >= self.node.core.log.last_index()

    # ----------------------------------------------------------- joining

    def left_out(self, j: Join | None) -> bool:
        """Does the cluster, as its leader announces it, not count this node?
        (A newcomer; or a node that was removed while it was down and came
        back with its old configuration.)"""
        n = self.node
        if self.leaving or j is None or j.leader == n.id or n.is_leader:
            return False
        if not self.in_config():
            return True
        return bool(j.members) and j.term >= n.core.term and n.id not in j.members

    async def keep_in_cluster(self, leader: Callable[[], Join | None]) -> None:
        """Whenever the cluster leaves this node out, ask its leader (whoever
        discovery says it is) to add it as a learner; forever, every 2 s."""
        while True:
            j = leader()
            if self.left_out(j):
                assert j is not None
                await self._ask_to_join(j)
            await asyncio.sleep(2.0)

    async def _ask_to_join(self, j: Join) -> None:
        n = self.node
        n.update_addresses({j.leader: j.leader_address})
        try:
            async with tls.current().channel(j.leader_address) as ch:
                await admin_pb2_grpc.AdminStub(ch).AddNode(
                    admin_pb2.AddNodeRequest(node_id=n.id, address=n.cfg.address),
                    metadata=token_metadata(self.token),
                    timeout=10,
                )
            log.info("asked to join", extra={"leader": j.leader, "at": j.leader_address})
        except grpc.aio.AioRpcError as e:
            log.info("join refused, retrying", extra={"reason": e.details()})

    # ----------------------------------------------------------- leading

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(STEP_S)
            if not self.node.is_leader:
                self._leader_since = 0.0
                continue
            if not self._leader_since:
                self._leader_since = time.monotonic()
            try:
                await self.lead_step()
            except NotLeader:
                pass  # a change in flight, or leadership moved: next step
            except TimeoutError:
                log.warning("membership change not applied in time")
            except Exception:
                log.exception("membership step failed")

    async def lead_step(self) -> None:
        """At most one change (address or configuration) per step."""
        n = self.node
        core = n.core
        conf = core.conf
        if self.sync_addresses:
            book = n.sm.peers()
            stale = [
                command_pb2.Op(add_peer=command_pb2.AddPeerOp(node_id=m, address=addr))
                for m in sorted(conf.voters | conf.learners)
                if (addr := n.addresses.get(m)) and book.get(m) != addr
            ]
            if stale:  # all in one entry
                await asyncio.gather(*(n.propose_op(op) for op in stale))
                return
        if core.conf_history[-1][0] > core.log.committed:
            return  # a configuration change is still in flight
        target = n.cfg.target_voters
        now = time.monotonic()
        limit = n.cfg.dead_voter_timeout_s

        def silent(v: int) -> bool:
            heard = max(n.last_heard.get(v, 0.0), self._leader_since)
            return v != n.id and now - heard > limit

        dead = sorted(v for v in conf.voters if silent(v))
        ready = sorted(lrn for lrn in conf.learners if self.caught_up(lrn) and not silent(lrn))
        if ready and (len(conf.voters) < target or dead):
            log.info(
                "promoting a learner",
                extra={"node": ready[0], "replacing": dead[:1], "voters": sorted(conf.voters)},
            )
            await n.conf_change(ConfChange(ConfChangeType.ADD_VOTER, ready[0]))
            return
        if dead and len(conf.voters) > target:
            log.info("removing a dead voter", extra={"node": dead[0]})
            await n.conf_change(ConfChange(ConfChangeType.REMOVE_NODE, dead[0]))

    # ----------------------------------------------------------- leaving

    async def leave(self) -> int:
        """Hand leadership over if this node has it, then have the leader
        remove this node; the index of the removal."""
        n = self.node
        self.leaving = True
        if n.is_leader:
            others = [v for v in n.core.conf.voters if v != n.id and self.caught_up(v)]
            if not others:
                raise NotLeader(n.id, "no other caught-up voter to hand leadership to")
            await n.transfer_leader(max(others, key=lambda v: n.core.prs[v].match))
            for _ in range(100):
                if n.core.role != Role.LEADER and n.core.lead:
                    break
                await asyncio.sleep(0.05)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lead = n.core.lead
            addr = n.address_of(lead)
            if lead and addr and lead != n.id:
                try:
                    async with tls.current().channel(addr) as ch:
                        resp = await admin_pb2_grpc.AdminStub(ch).RemoveNode(
                            admin_pb2.RemoveNodeRequest(node_id=n.id),
                            metadata=token_metadata(self.token),
                            timeout=10,
                        )
                    return int(resp.index)
                except grpc.aio.AioRpcError as e:
                    log.info("leave refused, retrying", extra={"reason": e.details()})
            await asyncio.sleep(0.5)
        raise TimeoutError("the leader did not remove this node within 30 s")
