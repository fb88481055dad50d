"""Config files and flags of the node daemon and the queue server."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.config import ConfigError, load_config
from queue_server.config import load_queue_config

pytestmark = pytest.mark.unit


def test_node_config_from_toml_with_flag_overrides(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text(
        'node_id = 2\ncluster_name = "city"\ndata_dir = "/tmp/x"\nlisten = "127.0.0.1:7400"\n'
        'peers = ["1=10.0.0.1:7400", "2=10.0.0.2:7400"]\nmetrics_port = 9400\n'
        'queue_servers = ["10.0.0.9:7500"]\n'
    )
    cfg = load_config(f, {"data_dir": "/tmp/y", "metrics_port": None})
    assert cfg.node_id == 2 and cfg.cluster_name == "city"
    assert str(cfg.data_dir) == "/tmp/y"  # the flag wins
    assert cfg.peers == {1: "10.0.0.1:7400", 2: "10.0.0.2:7400"}
    assert cfg.metrics_port == 9400 and cfg.queue_servers == ["10.0.0.9:7500"]


def test_peers_as_a_table_and_as_a_flag(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('node_id = 1\n[peers]\n1 = "a:1"\n2 = "b:2"\n')
    assert load_config(f, {}).peers == {1: "a:1", 2: "b:2"}
    assert load_config(None, {"node_id": 1, "peers": "1=a:1,3=c:3"}).peers == {1: "a:1", 3: "c:3"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"node_id": 0, "peers": "1=a:1"}, "node_id"),
        ({"node_id": -1}, "node_id"),
        ({"discovery_port": 0}, "give peers, or discovery"),
        ({"discovery_seeds": "nohost"}, "discovery_seeds"),
        ({"bootstrap_expect": 99}, "bootstrap_expect"),
        ({"node_id": 1, "listen": "nohost"}, "listen"),
        ({"node_id": 1, "peers": "x=a:1"}, "peers"),
        ({"node_id": 1, "peers": "2=a:1"}, "must include this node"),
        ({"node_id": 1, "colour": "red"}, "unknown config keys"),
        ({"node_id": "one"}, "node_id"),
        ({"node_id": 1, "peers": "1=a:1", "snapshot_bytes": 0}, "snapshot_bytes"),
    ],
)
def test_bad_node_configs_name_the_key(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_broken_toml_file_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text("node_id = = 1\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(f, {})


def test_queue_config(tmp_path: Path) -> None:
    f = tmp_path / "q.toml"
    f.write_text('listen = "127.0.0.1:7500"\nmax_writes = 5\n')
    cfg = load_queue_config(f, {"max_reads": "7"})
    assert (cfg.max_writes, cfg.max_reads) == (5, 7)
    with pytest.raises(ConfigError, match="must be positive"):
        load_queue_config(None, {"max_writes": 0})


def test_the_example_config_files_load() -> None:
    root = Path(__file__).resolve().parents[3] / "etc"
    node = load_config(root / "node.toml.example", {})
    assert node.node_id == 1 and len(node.peers) == 3 and node.election_ticks == 25
    q = load_queue_config(root / "queue.toml.example", {})
    assert q.listen == "0.0.0.0:7500" and q.metrics_port == 9500


def test_a_daemon_refuses_a_missing_short_placeholder_or_world_readable_secret(
    tmp_path: Path,
) -> None:
    """Issue 19, finding 5: a missing or empty secret was accepted silently,
    and the inventory's CHANGE-ME placeholder passed."""
    from roadlog.runtime.config import check_secret

    def secret(text: str, mode: int = 0o600) -> Path:
        f = tmp_path / f"s{len(list(tmp_path.iterdir()))}"
        f.write_text(text)
        f.chmod(mode)
        return f

    with pytest.raises(ConfigError, match="not set"):
        check_secret(None)
    with pytest.raises(ConfigError, match="cannot read"):
        check_secret(tmp_path / "missing")
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        check_secret(secret("\n"))
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        check_secret(secret("short-secret\n"))
    with pytest.raises(ConfigError, match="placeholder"):
        check_secret(secret("CHANGE-ME-to-32-random-hex-characters\n"))
    # Issue 39, finding 6: 64 identical characters were taken.
    with pytest.raises(ConfigError, match="one pattern of 1 byte"):
        check_secret(secret("s" * 64 + "\n"))
    with pytest.raises(ConfigError, match="one pattern of 4 byte"):
        check_secret(secret("abcd" * 8 + "\n"))
    with pytest.raises(ConfigError, match="distinct bytes"):
        check_secret(secret("a" * 40 + "b" + "\n"))
    with pytest.raises(ConfigError, match="open to others"):
        check_secret(secret("9f1c2a7e4b8d6f3a0c5e7b9d1f3a5c7e\n", 0o644))
    check_secret(secret("9f1c2a7e4b8d6f3a0c5e7b9d1f3a5c7e\n", 0o640))  # root:roadlog, as deployed
    # (more in test_private_files.py: groups, owners, the one-line refusal, the role)
