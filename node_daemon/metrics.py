"""Prometheus metrics of the node daemon (served on ``metrics_port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from roadlog.runtime.build_info import BUILD_INFO as BUILD_INFO  # exported with the rest

ROLE = Gauge("roadlog_raft_role", "0 follower, 1 pre-candidate, 2 candidate, 3 leader")
TERM = Gauge("roadlog_raft_term", "current Raft term")
COMMIT_INDEX = Gauge("roadlog_raft_commit_index", "highest index known committed")
APPLIED_INDEX = Gauge("roadlog_raft_applied_index", "highest index applied to the state machine")
# Each Raft group this node runs (docs/multiraft.md), labelled by group; the
# unlabelled figures above are group 0's, the metadata group's.
GROUP_ROLE = Gauge(
    "roadlog_raft_group_role", "role in each Raft group (as roadlog_raft_role)", ["group"]
)
GROUP_TERM = Gauge("roadlog_raft_group_term", "current term of each Raft group", ["group"])
GROUP_COMMIT_INDEX = Gauge(
    "roadlog_raft_group_commit_index", "highest index known committed, per Raft group", ["group"]
)
GROUP_APPLIED_INDEX = Gauge(
    "roadlog_raft_group_applied_index", "highest index applied, per Raft group", ["group"]
)
GROUP_SNAPSHOT_INDEX = Gauge(
    "roadlog_raft_group_snapshot_index", "index each Raft group's log is compacted to", ["group"]
)
LOG_KEPT_FROM = Gauge(
    "roadlog_raft_log_kept_from_index",
    "lowest index each Raft group's log keeps: below its snapshot's, the entries whose ping "
    "batches the state refers to (one copy per node); retention moves it up",
    ["group"],
)
LEADER_HANDOVERS = Counter(
    "roadlog_raft_group_leader_handovers_total",
    "data groups this node handed to their preferred leader (leaders spread)",
    ["group"],
)
LEADER_DISK_HANDOVERS = Counter(
    "roadlog_raft_group_leader_disk_handovers_total",
    "groups (group 0 too) this node handed to a voter with room because its own disk was low "
    "(it refuses growing writes)",
    ["group"],
)
APPENDED_ENTRIES = Counter("roadlog_raft_appended_entries_total", "entries persisted to the log")
PROPOSED_OPS = Counter("roadlog_proposed_ops_total", "operations proposed by this node as leader")
FSYNC_SECONDS = Histogram(
    "roadlog_raft_log_write_seconds",
    "time of one synced write of the Raft log (one fsync)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)
LOG_STORE_SAVES = Histogram(
    "roadlog_log_store_groups_per_commit",
    "groups' log writes one synced transaction of a log store carried (group commit)",
    buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64),
)
FOLLOWER_LAG = Gauge(
    "roadlog_raft_follower_lag_entries", "entries a follower is behind (leader only)", ["follower"]
)
STAGE_SECONDS = Histogram(
    "roadlog_work_stage_seconds",
    "time of each stage of a write on the leader",
    ["stage"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)
WORK_DONE = Counter("roadlog_work_done_total", "work items this node finished", ["kind"])
MERGED_PUBLISHES = Histogram(
    "roadlog_merged_publishes",
    "publish requests merged into one round of append ops (server-side group commit)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
SNAPSHOT_SECONDS = Histogram(
    "roadlog_snapshot_seconds",
    "time to take a snapshot (a copy of the state machine, paced by snapshot_mib_per_s, "
    "then its fsync); on a thread of its own, writes go on meanwhile",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
STATE_FSYNC_FAILED = Gauge(
    "roadlog_state_fsync_failed",
    "1 once an fsync of a Raft group's state failed: its log is no longer compacted (and grows) "
    "until the node restarts",
    ["group"],
)
STATE_FLUSH_SECONDS = Histogram(
    "roadlog_state_flush_seconds",
    "time an fsync of the state machine's commits took (every 0.25 s while it applies, on "
    "a thread of its own): what a slow or failing data disk shows first",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
)
PEER_STREAM_WRITES = Counter(
    "roadlog_peer_stream_writes_total",
    "stream messages written to peers (each carries one or more Raft messages)",
)
PEER_MESSAGES_SENT = Counter(
    "roadlog_peer_messages_sent_total", "Raft messages sent to peers, by type", ["type"]
)
SNAPSHOT_INDEX = Gauge("roadlog_snapshot_index", "index of the snapshot the log is compacted to")
DISK_FREE_BYTES = Gauge(
    "roadlog_disk_free_bytes", "free bytes on the data directory's filesystem (last look)"
)
DISK_LOW = Gauge(
    "roadlog_disk_low",
    "1 while the disk is below min_free_bytes or a write waits for room (growing writes refused)",
)
STORAGE_FULL_RETRIES = Counter(
    "roadlog_storage_full_retries_total",
    "log writes, applies and snapshot installs tried again for want of space",
    ["what"],
)
DAMAGED_LOGS_SET_ASIDE = Counter(
    "roadlog_damaged_logs_set_aside_total",
    "Raft logs found corrupt or truncated at start and set aside (the node caught up again)",
    ["group"],
)
STATES_REBUILT = Counter(
    "roadlog_states_rebuilt_total",
    "state machines rebuilt from the snapshot and the log at start (torn by a power loss "
    "or found damaged)",
    ["group"],
)
