"""Every Raft group a node runs, in one process (docs/multiraft.md, step 2).

Group 0, the metadata group, is the node as it always was: its log, state
and snapshots in the data directory, and the peer transport. Data groups
1..G (``data_groups`` above 1) each run a ``Replica`` of their own, with
their own log, state machine and snapshots under ``groups/<g>``, and share
group 0's links to the peers (every message says its group).

Invariants:
- The groups share the transport, the event loop, the process and the
  data groups' log store (``storage.log_store``: one LMDB environment, one
  transaction and one fsync a turn of the loop for every group with
  entries to persist); each has its own core, driver, state machine and
  applies, so one group's election or snapshot never waits on another's.
  Group 0 keeps a log of its own. (State machines: one environment per
  group still.) The data groups share one round (``replica.round``): one
  Ready pass a turn of the loop for every data group with work, then one
  frame per peer and one commit for all of them; group 0 keeps a driver
  task of its own.
- One ticker ticks every group in the same turn of the event loop, so the
  heartbeats all groups send to a peer in a tick leave in one batch. It
  ticks lazily (``Replica.owe_ticks``): it sleeps until the first tick at
  which some group's core may act (a heartbeat, an election timeout), or
  LAZY_CHORES_S at most, and each group's core is handed every tick it
  slept through before anything else reaches it; so the cores see the
  ticks an every-``tick_ms`` ticker gives, and an idle process wakes for
  its heartbeats and timeouts, not 50 times a second.
- A node crash takes all its groups down at once (one process); a stop
  stops the data groups first, then group 0, which owns the transport.
- With data groups, each node hands the data groups it leads to their
  preferred leaders once those are healthy (``leader_balance``), so the
  groups' leaders, and their write load, spread over the nodes.
- A leader whose disk is low hands each group it leads, group 0 too, to a
  healthy voter whose disk is not known to be low (``leader_balance``); no
  leader hands a group to a voter whose disk is known to be low. What this
  node says of its disk to its peers (``transport.disk_low``, on every
  batch) is set at every wake of the ticker (LAZY_CHORES_S apart at most)
  from its groups' disk guards: low if any is.
- A graceful stop first hands every group the node leads to another voter
  (``hand_over``), so no group waits out an election timeout for it.
- A worker process (docs/multiraft.md step 5) runs a share of the data
  groups and not group 0: it reads group 0 as a ``RemoteReplica`` (the main
  process's replica, read-only, and the figures it tells), and its groups
  have a transport of their own.
- Each data group's leader makes its group's membership follow group 0's
  (``data_group_membership``): a node that joins or leaves the cluster joins or
  leaves every group; and its topics too (``data_group_topics``): a topic with
  partitions in the group is placed there, and dropped when group 0 drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from node_daemon import metrics
from node_daemon.config import NodeConfig
from node_daemon.replica.remote import ReplicaView
from node_daemon.replica.replica import NotLeader, Replica
from node_daemon.replica.round import Round
from node_daemon.state.op_gate import OP_LEVEL
from node_daemon.storage.group_commit import GroupCommit
from node_daemon.storage.group_logs import check_store, group_data_dir
from node_daemon.storage.log_store import LogStore, store_dir
from node_daemon.store.cluster_membership import CATCH_UP_LAG, STEP_S
from node_daemon.store.data_group_lock import lock_data_groups
from node_daemon.store.data_group_membership import must_hand_over, next_change
from node_daemon.store.data_group_topics import next_topic_op
from node_daemon.store.leader_balance import ROUND_S, LeaderBalancer, successor, view_of
from node_daemon.transport.peer_disk import stale_after
from node_daemon.transport.peer_transport import PeerTransport
from roadlog.errors import Code, RoadlogError

log = logging.getLogger("roadlog.node")

LAZY_CHORES_S = 0.25  # the ticker wakes at least this often (disk, log clock, retention)


class Store:
    """The groups this process runs. ``local``: which (default: group 0 and
    every data group); without group 0 (a worker process), ``group0`` is
    group 0 as read from here and ``transport`` the process's own.
    ``remote``: the node's groups other processes run, as read from here
    (the main process's view of its workers' groups)."""

    def __init__(
        self,
        cfg: NodeConfig,
        local: Iterable[int] | None = None,
        group0: ReplicaView | None = None,
        transport: PeerTransport | None = None,
        remote: Mapping[int, ReplicaView] | None = None,
        log_store: str = "main",
    ) -> None:
        self.cfg = cfg
        if local is None:
            local = range(cfg.data_groups + 1) if cfg.data_groups > 1 else [0]
        groups = sorted(set(local))
        self.nodes: dict[int, Replica] = {}
        if 0 in groups:
            self.nodes[0] = Replica(cfg)
            transport = self.nodes[0].transport
        elif group0 is None or transport is None:
            raise ValueError("a process without group 0 reads it from elsewhere, on its own links")
        assert transport is not None
        self.transport = transport
        transport.op_level = OP_LEVEL  # said to the peers on every batch (op_gate)
        here: ReplicaView | None = self.nodes.get(0)
        self.group0: ReplicaView = here if here is not None else group0  # type: ignore[assignment]
        # No other process of this node runs these groups meanwhile.
        data_dir = Path(cfg.data_dir)
        self._locks = lock_data_groups(group_data_dir(data_dir, g) for g in groups if g)
        # The data groups' logs: one store (``log_store``: main, worker-<i>),
        # written once a turn of the loop for all of them (group commit).
        self.log_store: LogStore | None = None
        commits: GroupCommit | None = None
        self.round: Round | None = None
        if any(groups):
            path = store_dir(data_dir, log_store)
            alone = bool(cfg.peers) and set(cfg.peers) <= {cfg.node_id}
            check_store(path, [group_data_dir(data_dir, g) for g in groups if g], not alone)
            self.log_store = LogStore(path)
            commits = GroupCommit(self.log_store)
            self.round = Round(transport, commits)
        for g in groups:
            if g:
                self.nodes[g] = Replica(cfg, g, transport, commits, self.round)
        # What the groups read of each other: every group of the node.
        reads: dict[int, ReplicaView] = {0: self.group0, **(remote or {}), **self.nodes}
        for node in self.nodes.values():
            node.raft_groups = reads
            node.loop_mates = list(self.nodes.values())
        self.balancer = LeaderBalancer(cfg.node_id)
        self.transport.peer_disks.stale_s = stale_after(
            cfg.tick_ms, cfg.heartbeat_ticks, cfg.election_ticks
        )
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def meta(self) -> Replica:
        """Group 0, run here (the main process)."""
        return self.nodes[0]

    @property
    def data(self) -> dict[int, Replica]:
        """The data groups run here (none when every partition is in group 0)."""
        return {g: n for g, n in self.nodes.items() if g != 0}

    def update_addresses(self, known: dict[int, str]) -> None:
        for node in self.nodes.values():
            node.update_addresses(known)
        if 0 not in self.nodes:  # no group here owns the transport
            merged = {**self.transport.addresses, **known}
            merged.pop(self.cfg.node_id, None)
            self.transport.set_addresses(merged)

    async def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        for node in self.nodes.values():
            await node.start(on_failure, own_ticker=False, lazy_ticks=True)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._tick_all())]
        self._tasks.append(loop.create_task(self._balance_leaders()))
        if self.data:
            self._tasks.append(loop.create_task(self._follow_group_0()))

    async def _follow_group_0(self) -> None:
        """Every STEP_S: each data group this node leads takes the next
        change toward group 0's configuration (one at a time per group),
        then, with none to make, the next op toward group 0's topics."""
        topics_at = -1  # group 0's applied index when its topics were read
        meta_topics: dict[str, Any] = {}
        while True:
            await asyncio.sleep(STEP_S)
            group0 = self.group0
            try:
                state = group0.sm
                if state.applied_index != topics_at:
                    topics_at = state.applied_index
                    meta_topics = state.topic_records()
            except RoadlogError as e:  # group 0's replica here is not ready
                log.debug("group 0 not readable", extra={"error": e.message})
                continue
            meta = group0.conf_state()
            for g, node in sorted(self.data.items()):
                if not node.is_leader:
                    continue
                core = node.core
                if must_hand_over(meta, self.cfg.node_id):
                    target = successor(core)
                    if target and target in meta.voters and not core.lead_transferee:
                        with contextlib.suppress(NotLeader):
                            await node.transfer_leader(target)
                    continue
                last = core.log.last_index()

                def caught_up(n: int, core: Any = core, last: int = last) -> bool:
                    pr = core.prs.get(n)
                    return pr is not None and pr.match + CATCH_UP_LAG >= last

                cc = next_change(meta, core.conf, caught_up, self.cfg.node_id)
                if cc is None:
                    await self._follow_topics(g, node, meta_topics)
                    continue
                log.info(
                    "data group follows group 0's membership",
                    extra={"group": g, "change": cc.type.name.lower(), "node": cc.node_id},
                )
                try:
                    await asyncio.wait_for(node.conf_change(cc), 10)
                except (NotLeader, TimeoutError, ValueError) as e:
                    log.info("membership change not made", extra={"group": g, "error": str(e)})

    async def _balance_leaders(self) -> None:
        """Every ROUND_S: hand a group this node leads off it if its disk is
        low, or a data group to its preferred leader, if one is due (at most
        one per round; ``leader_balance``)."""
        while True:
            await asyncio.sleep(ROUND_S)
            now = time.monotonic()
            disks = self.transport.peer_disks
            views = [
                view_of(
                    g,
                    n.core,
                    n.disk.low,
                    {p: disks.low(p, now) for p in n.core.conf.voters if p != self.cfg.node_id},
                )
                for g, n in sorted(self.nodes.items())
            ]
            for group, target, why in self.balancer.decide(now, views):
                node = self.nodes[group]
                if why == "disk_low":
                    log.warning(
                        "handing a group off this node: its disk is low",
                        extra={
                            "group": group,
                            "to": target,
                            "free_bytes": node.disk.free_now,
                            "min_free_bytes": node.disk.min_free_bytes,
                        },
                    )
                    metrics.LEADER_DISK_HANDOVERS.labels(str(group)).inc()
                else:
                    log.info(
                        "handing a data group to its preferred leader",
                        extra={"group": group, "to": target},
                    )
                    metrics.LEADER_HANDOVERS.labels(str(group)).inc()
                with contextlib.suppress(NotLeader):  # lost it meanwhile: nothing to hand
                    await node.transfer_leader(target)

    async def hand_over(self, timeout: float = 5.0) -> dict[int, int]:
        """Before a graceful stop: hand every group this node leads to its
        best follower (``successor``) and wait, up to ``timeout``, until each
        has a leader that is not this node. Stops the balancer first, so
        nothing hands a group back. Returns {group: whom it went to} for
        the hand-overs that took."""
        for t in self._tasks[1:]:  # the balancer (the ticker keeps ticking)
            t.cancel()
        targets: dict[int, int] = {}
        for g, node in sorted(self.nodes.items()):
            if not node.is_leader:
                continue
            target = successor(node.core)
            if target == 0:
                continue
            with contextlib.suppress(NotLeader):
                await node.transfer_leader(target)
                targets[g] = target
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
            self.nodes[g].is_leader or self.nodes[g].core.lead == 0 for g in targets
        ):
            await asyncio.sleep(0.02)
        done = {g: self.nodes[g].core.lead for g in targets if not self.nodes[g].is_leader}
        if targets:
            log.info(
                "handed leadership over before stopping",
                extra={"groups": {str(g): t for g, t in done.items()}, "asked": len(targets)},
            )
        return done

    async def _follow_topics(self, g: int, node: Replica, meta_topics: dict[str, Any]) -> None:
        op = next_topic_op(meta_topics, node.sm.topic_records(), g)
        if op is None:
            return
        kind = op.WhichOneof("op")
        name = op.place_topic.topic.spec.name if kind == "place_topic" else op.delete_topic.name
        log.info(
            "data group follows group 0's topics", extra={"group": g, "op": kind, "topic": name}
        )
        try:
            res = await asyncio.wait_for(node.propose_op(op), 10)
        except (NotLeader, TimeoutError) as e:
            log.info("topic op not made", extra={"group": g, "error": str(e)})
            return
        if res.code != Code.OK:
            log.warning("topic op refused", extra={"group": g, "error": res.message})

    async def _tick_all(self) -> None:
        """The groups' lazy ticker (see the module docstring)."""
        loop = asyncio.get_running_loop()
        nodes = list(self.nodes.values())
        transport = self.transport
        woken = asyncio.Event()
        wake_at = [0.0]  # when the ticker sleeps until

        def due(at: float) -> None:  # a group's first tick that may act moved
            if at < wake_at[0]:
                woken.set()  # sooner than the ticker would wake: wake it now

        for node in nodes:
            node.ticks.on_due = due
        while True:
            now = time.monotonic()
            # What every batch to the peers says of this node's disk (each
            # guard looks at most every LOOK_EVERY_S).
            transport.disk_low = any(node.disk.low for node in nodes)
            for node in nodes:
                node.lazy_tick(now)  # the ticks owed (none before its boundary), chores
            at = min(now + LAZY_CHORES_S, *(node.ticks.due_at for node in nodes))
            wake_at[0] = at
            woken.clear()
            timer = loop.call_later(max(0.0, at - time.monotonic()), woken.set)
            try:
                await woken.wait()
            finally:
                timer.cancel()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for node in self.data.values():
            await node.stop()
        if 0 in self.nodes:
            await self.nodes[0].stop()
        else:
            await self.transport.close()
        if self.log_store is not None:
            self.log_store.close()
        for fd in self._locks:
            os.close(fd)
        self._locks = []
