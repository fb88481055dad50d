"""The node daemon's configuration: a TOML file, each key also a flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roadlog.placement import MAX_DATA_GROUPS, worker_processes
from roadlog.runtime import config as configfile
from roadlog.runtime.config import ConfigError, check_address, key

__all__ = ["ConfigError", "NodeConfig", "check_address", "load_config", "parse_peers"]


def parse_peers(value: Any) -> dict[int, str]:
    """Peers as a TOML table {"1" = "host:port"}, a list of "ID=HOST:PORT",
    or the same comma-separated (as a flag)."""
    if isinstance(value, dict):
        items = [(str(k), str(v)) for k, v in value.items()]
    else:
        parts = value.split(",") if isinstance(value, str) else list(value)
        items = []
        for p in parts:
            if "=" not in str(p):
                raise ConfigError(f"peers: {p!r} is not ID=HOST:PORT")
            k, v = str(p).split("=", 1)
            items.append((k.strip(), v.strip()))
    out: dict[int, str] = {}
    for k, v in items:
        if not k.isdigit() or int(k) <= 0:
            raise ConfigError(f"peers: node id {k!r} must be a positive integer")
        check_address(v, "peers")
        out[int(k)] = v
    return out


@dataclass
class NodeConfig:
    """Every key of a node's TOML file, each also a flag of ``roadlog-node run``."""

    node_id: int = key(0, "this node's id (with peers; with discovery it is made once)")
    cluster_name: str = key("roadlog", "the cluster's name (nodes of other names are refused)")
    data_dir: Path = key(Path("/var/lib/roadlog"), "where the LMDB log, state and snapshots live")
    listen: str = key("0.0.0.0:7400", "HOST:PORT for peers, admin and health")
    advertise_address: str = key("", "HOST:PORT others reach this node at (default: listen)")
    peers: dict[int, str] = key(
        help="ID=HOST:PORT,... (every voter of a new cluster, this node too)", factory=dict
    )
    secret_file: Path | None = key(None, "the file holding the shared cluster secret")
    # TLS on every port (roadlog/runtime/tls.py): ca.crt, node.crt, node.key
    # (made by `roadlog ca create-node`; the key 0600). The node's id is the
    # one its certificate names.
    certs_dir: Path | None = key(None, "directory of ca.crt, node.crt and node.key (TLS)")
    insecure: bool = key(False, "no TLS: plaintext, unauthenticated ports (debugging only)")
    metrics_port: int = key(9400, "port of Prometheus /metrics, /healthz and /readyz")
    # Metrics tell topics, rates and roles to whoever reaches them (issue 19,
    # finding 15): bind them to the management network's address.
    metrics_host: str = key("", "address the metrics port binds (empty: listen's host)")
    # Who may read the metrics port (roadlog/runtime/health.py; issue 39).
    metrics_auth: str = key(
        "none",
        "who may read /metrics, /healthz, /readyz: none (anyone), token (a bearer token, "
        "metrics_token_file) or tls (a client certificate the cluster's CA signed)",
    )
    metrics_token_file: Path | None = key(
        None, "the file holding the metrics port's bearer token (metrics_auth = token)"
    )
    # Raft traffic between nodes on a lean framed link (see peer_frames.py);
    # peers learn the port over gRPC, so any port works. Taken by another
    # process, the node warns and peers stream over gRPC on `listen`.
    peer_frames_port: int = key(
        7401, "TCP port of the framed Raft peer link on listen's host (0: any; -1: off)"
    )
    queue_servers: list[str] = key(
        help="HOST:PORT,... of the queue servers to pull work from", factory=list
    )
    tick_ms: int = key(20, "one Raft tick, in milliseconds (10..10000)")
    # Heartbeat every 5 ticks (100 ms); election timeout randomized over
    # [25, 50) ticks (500-1000 ms): fine-grained, so that two followers of a
    # dead leader rarely time out in the same tick and split the vote.
    election_ticks: int = key(25, "election timeout in ticks (randomized up to twice this)")
    heartbeat_ticks: int = key(5, "ticks between a leader's heartbeats")
    snapshot_entries: int = key(20_000, "snapshot and compact the log this far behind applied")
    # A log of big ping batches reaches snapshot_bytes long before
    # snapshot_entries. A state bigger than this is snapshotted only once
    # the log is half its size.
    snapshot_bytes: int = key(256 << 20, "... or once the applied log holds this many bytes")
    # A snapshot copies the whole state; unpaced, that burst is what the
    # log's fsyncs on the same disk wait behind (ack p99 x4 at 1000 pings per
    # message, bench/profiles/write-path.md). Below the disk's throughput.
    snapshot_mib_per_s: int = key(
        64, "write a snapshot at most this fast, MiB/s (0: as fast as the disk takes it)"
    )
    max_ops_per_entry: int = key(256, "ops packed into one Raft entry, at most")
    merge_publishes: bool = key(
        True, "server-side group commit: merge publishes that arrive together (default on)"
    )
    # Discovery (UDP HELLOs; see discovery/). With discovery, `peers` and
    # `node_id` may be left out: the node makes an id once, keeps it in its
    # data dir, and founds or joins a cluster by what it hears.
    discovery_port: int = key(7499, "UDP port of discovery HELLOs (0: none)")
    discovery_broadcast: str = key(
        "255.255.255.255", "where HELLOs are broadcast ('' for seeds only)"
    )
    discovery_seeds: list[str] = key(
        help="HOST:PORT,... to send HELLOs to by unicast", factory=list
    )
    bootstrap_expect: int = key(0, "found a new cluster of this many nodes (0..15)")
    # Multi-raft (issue 18; docs/multiraft.md): the node runs data groups 1..G
    # beside group 0, over the same peer links, and new topics' partitions are
    # placed in them (place_topics). G is fixed when the cluster is founded:
    # 0 resolves once, at the node's first start, to one group per voter (or,
    # for a node joining a running cluster, to what its leader runs), and a
    # data directory that exists keeps what it was founded with (one group
    # for one made before groups): node_daemon/store/founded_data_groups.py.
    data_groups: int = key(
        0,
        "Raft groups for pings, fixed when the cluster is founded (0: one per voter; "
        "1: every ping in group 0; 1..64)",
    )
    # Publishes, fetches, topic offsets, give-to-get, consumer commits, Spark
    # and backups follow the data groups (docs/multiraft.md).
    place_topics: bool = key(
        True,
        "with data_groups above 1, place new topics' partitions in the data groups "
        "(--no-place-topics: keep them in group 0; the data groups then hold no pings)",
    )
    # Worker processes (docs/multiraft.md step 5): with data_groups above 1,
    # the node runs group 0 in its main process and the data groups in
    # ``worker_processes`` worker processes, each on a core of its own (group
    # g in worker (g-1) mod that many).
    workers: int = key(
        0,
        "processes for the data groups (0: one per core; 1: all in the main process; "
        "at most one per data group; 0..64)",
    )
    # Fixed ports, for the firewall: worker i's gRPC port (peers' snapshots,
    # the Raft stream's fallback) is worker_ports + 2i, its framed Raft link
    # worker_ports + 2i + 1, on listen's host; peers learn them from the main
    # process (group_ports). A port taken: the worker warns and takes any.
    worker_ports: int = key(
        7410, "first TCP port of the worker processes, two each (0: any free ports)"
    )
    voters: int = key(0, "voters to keep, learners beyond are standbys (0: bootstrap_expect or 3)")
    dead_voter_timeout_s: int = key(30, "a voter silent this long is replaced by a standby")
    trim_interval_s: int = key(60, "how often the leader applies retention through the log")
    # Room kept free on the data directory's filesystem: below it the node
    # (as leader) refuses appends, topic creates and heat maps, but serves
    # reads and takes deletes; a snapshot needs about the state's size.
    min_free_bytes: int = key(512 << 20, "below this many free bytes, refuse growing writes")
    # Producer ids one identity may hold (issue 19's quotas): the leader puts
    # it in every InitProducer it proposes and the apply refuses past it, so
    # one identity's concurrent calls cannot pass it (issue 39, finding 5).
    producer_ids_per_identity: int = key(
        1024, "producer ids one identity may hold at once (1..1000000; RESOURCE_EXHAUSTED beyond)"
    )
    log_level: str = key("info", "debug, info, warning or error")
    # What tells this boot of the host from the last one (see node_daemon/storage/boot.py).
    boot_id_file: Path = key(
        Path("/proc/sys/kernel/random/boot_id"), "a file naming this boot of the host"
    )

    @property
    def worker_processes(self) -> int:
        """How many worker processes run the data groups: ``workers`` (0: one
        per core this process may run on), at most one per data group; 1
        means none (every group in the main process), as with one group."""
        return worker_processes(self.data_groups, self.workers)

    @property
    def placement_groups(self) -> int:
        """The data groups a new topic's partitions are placed in
        (``CreateTopicOp.data_groups``): 1, so group 0, unless
        ``place_topics`` (docs/multiraft.md, step 3)."""
        return max(1, self.data_groups) if self.place_topics else 1

    def validate(self) -> None:
        configfile.check_metrics_auth(self.metrics_auth, self.metrics_token_file, self.insecure)
        if self.node_id < 0 or (self.node_id == 0 and self.peers):
            raise ConfigError("node_id: must be a positive integer (with peers)")
        if not self.peers and not self.discovery_port:
            raise ConfigError("give peers, or discovery (discovery_port and bootstrap_expect)")
        if not 0 <= self.bootstrap_expect <= 15:
            raise ConfigError("bootstrap_expect: must be in 0..15")
        if not 0 <= self.data_groups <= MAX_DATA_GROUPS:
            raise ConfigError(f"data_groups: must be in 0..{MAX_DATA_GROUPS} (0: one per voter)")
        if not 0 <= self.workers <= MAX_DATA_GROUPS:
            raise ConfigError(f"workers: must be in 0..{MAX_DATA_GROUPS}")
        if not 0 <= self.worker_ports <= 65535 - 2 * self.worker_processes:
            raise ConfigError("worker_ports: must be in 0..65535, with two ports for each worker")
        if not 0 <= self.voters <= 15 or self.dead_voter_timeout_s < 1:
            raise ConfigError("voters: 0..15; dead_voter_timeout_s: at least 1")
        for seed in self.discovery_seeds:
            check_address(seed, "discovery_seeds")
        check_address(self.listen, "listen")
        if self.advertise_address:
            check_address(self.advertise_address, "advertise_address")
        for q in self.queue_servers:
            check_address(q, "queue_servers")
        if self.peers and self.node_id not in self.peers:
            raise ConfigError(f"peers: must include this node ({self.node_id})")
        if not -1 <= self.peer_frames_port <= 65535:
            raise ConfigError("peer_frames_port: must be in -1..65535 (-1: off, 0: any)")
        if not 10 <= self.tick_ms <= 10_000:
            raise ConfigError("tick_ms: must be in 10..10000")
        if self.snapshot_entries < 1 or self.snapshot_bytes < 1:
            raise ConfigError("snapshot_entries and snapshot_bytes: must be positive")
        if self.snapshot_mib_per_s < 0:
            raise ConfigError("snapshot_mib_per_s: must be 0 (unpaced) or more")
        if self.election_ticks <= self.heartbeat_ticks:
            raise ConfigError("election_ticks: must exceed heartbeat_ticks")
        if not 1 <= self.producer_ids_per_identity <= 1_000_000:
            raise ConfigError("producer_ids_per_identity: must be in 1..1000000")

    @property
    def address(self) -> str:
        return self.advertise_address or self.listen

    @property
    def discovery(self) -> bool:
        """Cold start by discovery (no static peer list)."""
        return not self.peers and self.discovery_port > 0

    @property
    def target_voters(self) -> int:
        return self.voters or self.bootstrap_expect or 3

    @property
    def voters_at_founding(self) -> int:
        """The voters the cluster is founded with: the static peer list's
        (at most ``target_voters``), or ``target_voters`` with discovery."""
        if self.peers:
            return max(1, min(len(self.peers), self.target_voters))
        return self.target_voters

    def secret(self) -> bytes:
        return configfile.read_secret(self.secret_file)


def _list(v: Any) -> list[str]:
    return [s for s in v.split(",") if s] if isinstance(v, str) else list(v)


def load_config(path: Path | None, overrides: dict[str, Any]) -> NodeConfig:
    return configfile.load(
        NodeConfig,
        path,
        overrides,
        {
            "peers": parse_peers,
            "data_dir": Path,
            "secret_file": Path,
            "certs_dir": Path,
            "metrics_token_file": Path,
            "queue_servers": _list,
            "discovery_seeds": _list,
        },
    )
