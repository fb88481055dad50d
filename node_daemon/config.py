"""The node daemon's configuration: a TOML file, each key also a flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roadlog.runtime import config as configfile
from roadlog.runtime.config import ConfigError, check_address

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
    node_id: int = 0
    cluster_name: str = "roadlog"
    data_dir: Path = Path("/var/lib/roadlog")
    listen: str = "0.0.0.0:7400"
    advertise_address: str = ""
    peers: dict[int, str] = field(default_factory=dict)
    secret_file: Path | None = None
    metrics_port: int = 9400
    queue_servers: list[str] = field(default_factory=list)
    tick_ms: int = 20
    # Heartbeat every 5 ticks (100 ms); election timeout randomized over
    # [25, 50) ticks (500-1000 ms): fine-grained, so that two followers of a
    # dead leader rarely time out in the same tick and split the vote.
    election_ticks: int = 25
    heartbeat_ticks: int = 5
    snapshot_entries: int = 20_000  # compact the log this far behind the applied index
    # ... or once the applied part of the log holds this many bytes (a log
    # of big ping batches reaches it long before snapshot_entries). A state
    # bigger than this is snapshotted only once the log is half its size.
    snapshot_bytes: int = 256 << 20
    max_ops_per_entry: int = 256  # server-side batching of writes into one entry
    # Merge publishes that arrive while the leader persists into one append
    # op per topic (server-side group commit). Off: one op per publish.
    merge_publishes: bool = True
    # Discovery (UDP HELLOs; see discovery/). With discovery, `peers` and
    # `node_id` may be left out: the node makes an id once, keeps it in its
    # data dir, and founds or joins a cluster by what it hears.
    discovery_port: int = 7499  # 0: no discovery
    discovery_broadcast: str = "255.255.255.255"  # "": seeds only (no broadcast)
    discovery_seeds: list[str] = field(default_factory=list)  # HOST:PORT, unicast HELLOs
    bootstrap_expect: int = 0  # found a new cluster once this many nodes agree
    voters: int = 0  # voters to keep (learners beyond are standbys); 0: bootstrap_expect or 3
    dead_voter_timeout_s: int = 30  # a silent voter is replaced by a caught-up learner
    trim_interval_s: int = 60  # how often the leader applies retention through the log
    log_level: str = "info"

    def validate(self) -> None:
        if self.node_id < 0 or (self.node_id == 0 and self.peers):
            raise ConfigError("node_id: must be a positive integer (with peers)")
        if not self.peers and not self.discovery_port:
            raise ConfigError("give peers, or discovery (discovery_port and bootstrap_expect)")
        if not 0 <= self.bootstrap_expect <= 15:
            raise ConfigError("bootstrap_expect: must be in 0..15")
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
        if not 10 <= self.tick_ms <= 10_000:
            raise ConfigError("tick_ms: must be in 10..10000")
        if self.snapshot_entries < 1 or self.snapshot_bytes < 1:
            raise ConfigError("snapshot_entries and snapshot_bytes: must be positive")
        if self.election_ticks <= self.heartbeat_ticks:
            raise ConfigError("election_ticks: must exceed heartbeat_ticks")

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
            "queue_servers": _list,
            "discovery_seeds": _list,
        },
    )
