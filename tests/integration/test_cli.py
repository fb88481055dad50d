"""The `roadlog` command line, driven from outside as a user would, through
exactly the command names, flags and JSON fields it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import settled

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def roadlog(
    *args: str, check: bool = True, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROADLOG_CLIENT_ID": "cli-test", **(env_extra or {})}
    env.pop("ROADLOG_SERVERS", None)
    return subprocess.run(
        [sys.executable, "-m", "roadlog.cli", *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,  # a question goes unanswered, never waits for a terminal
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=check,
    )


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "cluster"
    up = roadlog("cluster", "up", "--nodes", "3", "--queue-servers", "1", "--dir", str(d))
    assert up.stdout.strip().count(":") == 1  # the queue server's HOST:PORT
    try:
        yield d
    finally:
        roadlog("cluster", "down", "--dir", str(d), check=False)


def read_json(*args: str) -> Any:
    return json.loads(roadlog(*args).stdout)


def names_listed(d: str) -> list[str]:
    return [t["name"] for t in read_json("topic", "list", "--dir", d, "--json")]


def roadlog_status(d: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:  # the restarted node answers once it has heard the leader
        st: dict[str, Any] = json.loads(roadlog("cluster", "status", "--dir", d, "--json").stdout)
        if all(n["role"] != "down" for n in st["nodes"]) or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def write_inputs(tmp: Path, now: int) -> tuple[Path, Path, Path]:
    csv = tmp / "pings.csv"
    csv.write_text(
        "device_id,ts_ms,lat,lon,speed_mps,heading_deg\n"
        + "".join(f"car-{i % 3},{now + i},48.1{i % 10},11.5{i % 10},12.5,90\n" for i in range(30))
    )
    gpx = tmp / "ride.gpx"
    pts = "".join(
        f'<trkpt lat="48.1{i}" lon="11.5{i}"><time>2026-11-22T00:00:0{i}Z</time></trkpt>'
        for i in range(5)
    )
    gpx.write_text(
        '<?xml version="1.0"?><gpx xmlns="http://www.topografix.com/GPX/1/1">'
        f"<trk><name>bike-7</name><trkseg>{pts}</trkseg></trk></gpx>"
    )
    geo = tmp / "points.geojson"
    feats = [
        {
            "type": "Feature",
            "geometry": {"type": "Point", "coordinates": [11.55, 48.12]},
            "properties": {"device_id": "bus-1", "ts_ms": now + i, "speed_mps": 5.0},
        }
        for i in range(7)
    ]
    geo.write_text(json.dumps({"type": "FeatureCollection", "features": feats}))
    return csv, gpx, geo


def test_the_cli_end_to_end(cluster_dir: Path, tmp_path: Path) -> None:
    d = str(cluster_dir)
    st = json.loads(roadlog("cluster", "status", "--cluster", d, "--json").stdout)
    assert st["leader"] in {1, 2, 3} and st["term"] >= 1
    for n in st["nodes"]:
        assert {"id", "address", "role", "commit_index", "applied_index"} <= set(n)
    assert st["queue_servers"] and "grpc" in st["queue_servers"][0]
    servers = st["queue_servers"][0]["grpc"]
    # `cluster up` made the cluster's own CA and certificates (keys 0600); with
    # --servers (no --cluster) the CLI trusts what ROADLOG_CA_FILE says.
    assert (cluster_dir / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    client = cluster_dir / "certs" / "client"
    own_ca = {
        "ROADLOG_CA_FILE": str(client / "ca.crt"),
        "ROADLOG_CERT_FILE": str(client / "client.admin.crt"),
        "ROADLOG_KEY_FILE": str(client / "client.admin.key"),
        # The admin identity `cluster up` made (--cluster DIR finds it itself).
        "ROADLOG_TOKEN": (Path(d) / "admin.token").read_text().strip(),
    }
    by_servers = json.loads(
        roadlog("cluster", "status", "--servers", servers, "--json", env_extra=own_ca).stdout
    )
    assert by_servers["leader"] == st["leader"]
    # The spelling, `cluster status --dir DIR`, names the same cluster.
    by_dir = json.loads(roadlog("cluster", "status", "--dir", d, "--json").stdout)
    # The same nodes; their figures are live (a data group's commit index
    # moves between two asks: a leader's no-op, a leadership hand-over).
    assert by_dir["leader"] == st["leader"]
    assert [(n["id"], n["address"]) for n in by_dir["nodes"]] == [
        (n["id"], n["address"]) for n in st["nodes"]
    ]

    roadlog(
        "topic",
        "create",
        "munich",
        "--bbox",
        "11.4,48.05,11.75,48.25",
        "--partitions",
        "4",
        "--cluster",
        d,
    )
    # The CLI has no fence option (min_applied_index): each read below may
    # reach a node that has not applied the write before it yet, so it is
    # read again until it shows the write (settled: at most 30 s).
    listed = settled(
        lambda: read_json("topic", "list", "--cluster", d, "--json"),
        lambda got: [t["name"] for t in got] == ["munich"],
        "the created topic listed",
    )
    assert [t["name"] for t in listed] == ["munich"]
    bad = roadlog("topic", "create", "x", "--bbox", "1,2,3", "--cluster", d, check=False)
    assert bad.returncode != 0 and "bbox" in bad.stderr

    now = int(time.time() * 1000)
    csv, gpx, geo = write_inputs(tmp_path, now)
    for path, count in ((csv, 30), (gpx, 5), (geo, 7)):
        out = roadlog("produce", "munich", "--file", str(path), "--cluster", d, "--json").stdout
        assert json.loads(out.strip().splitlines()[-1]) == {"acknowledged": count}

    desc = settled(
        lambda: read_json("topic", "describe", "munich", "--cluster", d, "--json"),
        lambda got: got["pings"] == 42,
        "the produced pings described",
    )
    assert desc["pings"] == 42 and desc["partitions"] == 4
    # The default (README "Raft groups"): one data group per voter, the
    # topic's partitions placed in them, and `cluster status` lists group 0
    # and every data group, each with its partitions.
    by_partition = {o["partition"]: o["group"] for o in desc["offsets"]}
    assert sorted(by_partition) == [0, 1, 2, 3]
    assert set(by_partition.values()) <= {1, 2, 3} and len(set(by_partition.values())) > 1
    # A group's leader is the one a node says it is at the moment of asking:
    # under load a group can be between leaders (an election after a missed
    # heartbeat), or a node's answer can miss the probe's deadline, so the
    # status is asked again until every group names one (at most 30 s).
    groups = settled(
        lambda: read_json("cluster", "status", "--cluster", d, "--json")["groups"],
        lambda got: all(g["leader"] in {1, 2, 3} and g["commit_index"] >= 1 for g in got),
        "every group with a leader and a commit index in cluster status",
    )
    assert [g["id"] for g in groups] == [0, 1, 2, 3]
    assert {("munich", p): g["id"] for g in groups for _, p in g["partitions"]} == {
        ("munich", p): g for p, g in by_partition.items()
    }

    def consumed() -> list[Any]:
        out = roadlog(
            "consume",
            "munich",
            "--from-beginning",
            "--format",
            "jsonl",
            "--servers",
            servers,
            env_extra=own_ca,
        )
        return [json.loads(r) for r in out.stdout.strip().splitlines()]

    pings = settled(consumed, lambda got: len(got) == 42, "the produced pings consumed")
    assert len(pings) == 42
    assert {p["device_id"] for p in pings} == {"car-0", "car-1", "car-2", "bike-7", "bus-1"}
    csv_out = (
        roadlog(
            "consume",
            "munich",
            "--partition",
            "0",
            "--limit",
            "2",
            "--format",
            "csv",
            "--cluster",
            d,
        )
        .stdout.strip()
        .splitlines()
    )
    assert csv_out[0].startswith("partition,offset,device_id,ts_ms,lat,lon")
    assert len(csv_out) <= 3

    sim = roadlog(
        "simulate",
        "munich",
        "--vehicles",
        "10",
        "--duration",
        "20",
        "--hotspot",
        "11.575,48.137",
        "--cluster",
        d,
        "--json",
    )
    assert json.loads(sim.stdout.strip().splitlines()[-1])["acknowledged"] > 150

    roadlog("topic", "create", "scratch", "--bbox", "11.4,48.05,11.75,48.25", "--cluster", d)
    asked = roadlog("topic", "delete", "scratch", "--cluster", d, check=False)
    assert asked.returncode != 0  # no --yes and nobody to say yes: nothing deleted
    names = settled(
        lambda: names_listed(d), lambda got: sorted(got) == ["munich", "scratch"], "scratch listed"
    )
    assert sorted(names) == ["munich", "scratch"]  # and the delete below finds it
    gone = json.loads(roadlog("topic", "delete", "scratch", "--yes", "--dir", d, "--json").stdout)
    assert gone["deleted"] == "scratch" and gone["applied_index"] > 0
    names = settled(lambda: names_listed(d), lambda got: got == ["munich"], "scratch unlisted")
    assert names == ["munich"]
    again = roadlog("topic", "delete", "scratch", "--yes", "--dir", d, check=False)
    assert again.returncode != 0 and "no topic 'scratch'" in again.stderr

    leader = str(st["leader"])
    roadlog("cluster", "kill", leader, "--dir", d)
    out = roadlog("produce", "munich", "--file", str(csv), "--cluster", d, "--json").stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"acknowledged": 30}
    roadlog("cluster", "start", leader, "--cluster", d)  # --cluster works here as well
    node = next(n for n in roadlog_status(d)["nodes"] if str(n["id"]) == leader)
    assert node["role"] != "down"


def test_cli_errors_are_clear(tmp_path: Path) -> None:
    nowhere = roadlog("topic", "list", check=False)
    assert nowhere.returncode != 0 and "--cluster" in nowhere.stderr
    missing = roadlog("cluster", "status", "--cluster", str(tmp_path / "none"), check=False)
    assert missing.returncode != 0 and "no cluster" in missing.stderr
    # A status that reaches no node says so and fails, after printing what it saw.
    unreached = roadlog(
        "cluster", "status", "--servers", "127.0.0.1:9", "--json", check=False,
        env_extra={"ROADLOG_INSECURE": "1"},
    )  # fmt: skip
    assert unreached.returncode == 1 and "no node answered" in unreached.stderr
    assert json.loads(unreached.stdout)["leader"] == 0


@pytest.mark.parametrize(
    "flags", [[], ["--groups", "3", "--workers", "1"], ["--groups", "3", "--workers", "2"]],
    ids=["default", "one-process", "2-workers"],
)  # fmt: skip
def test_cluster_up_with_data_groups_places_a_topic_in_them(
    tmp_path: Path, flags: list[str]
) -> None:
    """`roadlog cluster up --groups G --workers W` (issue 18's contract): G
    data groups, every topic's partitions placed in them, run in W worker
    processes a node (1: in the node's main process); `topic describe
    --json` names each partition's group and `cluster status --json` lists
    every group with its leader, term, commit index and partitions. With
    neither flag: the defaults, one data group per voter (3) in one worker
    process per core (at most one per group)."""
    d = tmp_path / "cluster"
    up = roadlog("cluster", "up", *flags, "--dir", str(d))
    workers = int(flags[-1]) if flags else min(len(os.sched_getaffinity(0)), 3)
    try:
        assert "3 data group(s)" in up.stderr
        assert (f"in {workers} worker processes a node" in up.stderr) == (workers > 1)
        if not flags:  # the founding decision, kept in each node's data directory
            for n in range(1, 4):
                assert (d / f"node{n}" / "data_groups").read_text() == "3\n"
        roadlog("topic", "create", "munich", "--bbox", "11.3,48.0,11.8,48.3",
                "--partitions", "6", "--cluster", str(d))  # fmt: skip
        csv, _, _ = write_inputs(tmp_path, int(time.time() * 1000))
        out = roadlog("produce", "munich", "--file", str(csv), "--cluster", str(d), "--json")
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"acknowledged": 30}
        desc = settled(
            lambda: read_json("topic", "describe", "munich", "--cluster", str(d), "--json"),
            lambda got: got["pings"] == 30,
            "the produced pings described",
        )
        by_partition = {o["partition"]: o["group"] for o in desc["offsets"]}
        assert sorted(by_partition) == list(range(6))
        assert set(by_partition.values()) <= {1, 2, 3} and len(set(by_partition.values())) > 1

        def groups() -> list[dict[str, Any]]:
            st = read_json("cluster", "status", "--cluster", str(d), "--json")
            return list(st["groups"])

        listed = settled(groups, lambda gs: [g["id"] for g in gs] == [0, 1, 2, 3] and all(
            g["leader"] in {1, 2, 3} for g in gs), "every group with a leader")  # fmt: skip
        placed = {(t, p): g["id"] for g in listed for t, p in g["partitions"]}
        assert placed == {("munich", p): g for p, g in by_partition.items()}
        for g in listed:
            assert g["term"] >= 1 and g["commit_index"] >= 1
    finally:
        roadlog("cluster", "down", "--dir", str(d), check=False)
