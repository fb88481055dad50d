"""A replica's gauges: its group's figures, and for group 0 the node's own
(the disk, and the figures a node with one group always showed)."""

from __future__ import annotations

from node_daemon import metrics
from node_daemon.raft import RaftCore, Role
from node_daemon.storage.disk import DiskGuard


class GroupGauges:
    """Group ``group``'s gauges, looked up once: ``observe`` runs whenever
    the driver goes idle, several times a round."""

    def __init__(self, group: int, node_id: int) -> None:
        g = str(group)
        self.group, self.node_id = group, node_id
        self._gauges = (
            metrics.GROUP_ROLE.labels(g),
            metrics.GROUP_TERM.labels(g),
            metrics.GROUP_COMMIT_INDEX.labels(g),
            metrics.GROUP_APPLIED_INDEX.labels(g),
        )

    def observe(self, core: RaftCore, applied_index: int, disk: DiskGuard) -> None:
        role, term, commit, applied = self._gauges
        role.set(int(core.role))
        term.set(core.term)
        commit.set(core.log.committed)
        applied.set(applied_index)
        if self.group == 0:
            self._observe_node(core, applied_index, disk)

    def _observe_node(self, core: RaftCore, applied_index: int, disk: DiskGuard) -> None:
        """The node's own gauges: group 0's figures, and the disk."""
        metrics.DISK_FREE_BYTES.set(disk.free_now)
        metrics.DISK_LOW.set(int(disk.low))
        metrics.ROLE.set(int(core.role))
        metrics.TERM.set(core.term)
        metrics.COMMIT_INDEX.set(core.log.committed)
        metrics.APPLIED_INDEX.set(applied_index)
        if core.role == Role.LEADER:
            for node, pr in core.prs.items():
                if node != self.node_id:
                    metrics.FOLLOWER_LAG.labels(str(node)).set(core.log.last_index() - pr.match)
