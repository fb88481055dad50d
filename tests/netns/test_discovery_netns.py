"""Cold start by discovery on a real (namespaced) network: nodes that know
only the cluster name and its secret find each other, form exactly one
cluster, grow it, heal it, and ignore strangers."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import pytest

from roadlog.client import Admin, Connection, Producer
from roadlog.geo import bbox_region
from tests.integration.conftest import make_pings
from tests.netns.conftest import (
    REPO,
    Host,
    Net,
    digest,
    metric,
    node_status,
    one_cluster,
    views,
    wait_for,
)

pytestmark = pytest.mark.netns

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson


def start_shuffled(hosts: list[Host], expect: int, seed: int, spread_s: float = 3.0) -> None:
    """Start a node on each host in a seeded random order with random delays."""
    rng = random.Random(seed)
    order = list(hosts)
    rng.shuffle(order)
    for h in order:
        h.node(expect=expect)
        time.sleep(rng.uniform(0, spread_s / len(hosts)))


@pytest.mark.parametrize(("n", "expect"), [(3, 3), (5, 5)])
def test_nodes_started_in_random_order_form_one_cluster(net: Net, n: int, expect: int) -> None:
    seed = random.randrange(1 << 30)
    hosts = [net.host(i) for i in range(1, n + 1)]
    start_shuffled(hosts, expect, seed)
    wait_for(lambda: one_cluster(hosts, expect, n), 90, f"one cluster of {n} (seed {seed})")
    assert all(metric(h, "roadlog_discovery_datagrams_total{outcome=\"split_brain\"}") == 0
               for h in hosts)  # fmt: skip


def test_a_late_node_joins_catches_up_and_a_queue_server_is_found(net: Net) -> None:
    hosts = [net.host(i) for i in range(1, 4)]
    start_shuffled(hosts, 3, seed=7)
    wait_for(lambda: one_cluster(hosts, 3, 3), 90, "the first three")
    qhost = net.host(9)  # a queue server that only announces itself
    qhost.spawn(
        "queue",
        [
            sys.executable, "-m", "queue_server.main", "run",
            "--cluster-name", "netns",
            "--listen", f"{qhost.ip}:7500",
            "--secret-file", str(net.secret),
            "--insecure",
            "--client-auth", "none",  # no identities here: discovery is what is tested
            "--metrics-port", "0",
            "--discovery-broadcast", "10.77.0.255",
        ],
    )  # fmt: skip
    with Connection([f"{qhost.ip}:7500"], timeout=60) as conn:
        Admin(conn).create_topic("munich", REGION, 4)
        p = Producer(conn, "munich", client="netns")
        for k in range(20):
            p.send_batch(make_pings("netns", k * 500, 500, devices=16))
    late = net.host(4)
    late.node(expect=3)
    everyone = [*hosts, late]
    wait_for(lambda: one_cluster(everyone, 3, 4), 90, "the late node in the cluster")
    lead = next(iter(views(everyone).values())).leader
    assert late.index != lead
    wait_for(
        lambda: len({digest(h.node_address) for h in everyone}) == 1,
        60,
        "the late node caught up to an identical state",
    )
    v = views(everyone)
    assert late.index in v and v[late.index].id in set(v[hosts[0].index].learners)  # standby

    # The CLI finds the whole cluster from any one node ...
    st = json.loads(
        subprocess.check_output(
            [sys.executable, "-m", "roadlog.cli", "cluster", "status", "--json",
             "--servers", late.node_address],
            timeout=60,
        )
    )  # fmt: skip
    assert sorted(n["id"] for n in st["nodes"]) == sorted(n.id for n in v.values())
    assert st["leader"] == lead and all(n["role"] != "down" for n in st["nodes"])
    # ... and a client on the network finds the queue server by its
    # announcements, holding the discovery key only (not the secret).
    key = subprocess.check_output(
        [sys.executable, "-m", "node_daemon.process.main", "discovery-key", "--secret-file",
         str(net.secret)],
        timeout=60, text=True,
    ).strip()  # fmt: skip
    key_file = net.dir / "discovery.key"
    key_file.write_text(key + "\n")
    out = subprocess.check_output(
        ["ip", "netns", "exec", late.ns, sys.executable, "-m", "roadlog.cli", "topic", "list",
         "--json", "--discover", "--discovery-key-file", str(key_file)],
        timeout=60,
        cwd=REPO,
    )  # fmt: skip
    assert [t["name"] for t in json.loads(out)] == ["munich"]


def test_a_stranger_with_the_wrong_secret_is_ignored_and_counted(
    net: Net, tmp_path: object
) -> None:
    hosts = [net.host(i) for i in range(1, 4)]
    start_shuffled(hosts, 3, seed=3)
    wrong = net.dir / "wrong-secret"
    wrong.write_text("not-the-cluster-secret-at-all-0123456789\n")  # valid, only wrong
    wrong.chmod(0o600)  # a daemon refuses a secret others can read
    stranger = net.host(5)
    stranger.node(expect=3, secret=wrong)
    wait_for(lambda: one_cluster(hosts, 3, 3), 90, "the cluster without the stranger")
    wait_for(
        lambda: all(
            metric(h, 'roadlog_discovery_datagrams_total{outcome="rejected_bad_mac"}') >= 2
            for h in hosts
        ),
        30,
        "the stranger's datagrams counted as forged",
    )
    assert one_cluster(hosts, 3, 3)  # still just the three
    assert stranger.procs[0].popen.poll() is None  # it waits, alone


def test_a_dead_voter_is_replaced_and_a_restarted_node_rejoins(net: Net) -> None:
    hosts = [net.host(i) for i in range(1, 5)]
    for h in hosts:
        h.node(expect=3, extra=["--dead-voter-timeout-s", "3"])
    wait_for(lambda: one_cluster(hosts, 3, 4), 90, "three voters and a standby")
    v = views(hosts)
    lead = next(iter(v.values())).leader
    learner_id = next(iter(v[next(iter(v))].learners))
    victim = next(h for h in hosts if v[h.index].id not in (lead, learner_id))
    victim.procs[-1].kill(signal.SIGKILL)
    rest = [h for h in hosts if h is not victim]
    wait_for(lambda: one_cluster(rest, 3, 3), 60, "the standby replacing the dead voter")
    assert learner_id in set(views(rest)[rest[0].index].voters)
    # The dead node comes back with its data: it is the same node, and the
    # cluster takes it back (as a standby now).
    victim.node(expect=3, extra=["--dead-voter-timeout-s", "3"])
    wait_for(lambda: one_cluster(hosts, 3, 4), 90, "the restarted node back in the cluster")
    assert views(hosts)[victim.index].id == v[victim.index].id


def test_a_lossy_network_still_converges(net: Net) -> None:
    hosts = [net.host(i) for i in range(1, 4)]
    for h in hosts:
        h.lossy(30)
    start_shuffled(hosts, 3, seed=11)
    wait_for(lambda: one_cluster(hosts, 3, 3), 120, "one cluster despite 30% loss")


def test_seeds_instead_of_broadcast(net: Net) -> None:
    hosts = [net.host(i) for i in range(1, 4)]
    seeds = ",".join(f"{h.ip}:7499" for h in hosts)
    for h in hosts:
        h.node(expect=3, extra=["--discovery-broadcast", "", "--discovery-seeds", seeds])
    wait_for(lambda: one_cluster(hosts, 3, 3), 90, "one cluster from unicast seeds")
    assert all(metric(h, "roadlog_discovery_sent_total") > 0 for h in hosts)


def test_a_node_leaves_gracefully_even_as_leader(net: Net) -> None:
    hosts = [net.host(i) for i in range(1, 5)]
    for h in hosts:
        h.node(expect=3)
    wait_for(lambda: one_cluster(hosts, 3, 4), 90, "three voters and a standby")
    v = views(hosts)
    lead_id = next(iter(v.values())).leader
    leader = next(h for h in hosts if v[h.index].id == lead_id)
    out = subprocess.run(
        [sys.executable, "-m", "node_daemon.process.main", "leave",
         "--address", leader.node_address, "--secret-file", str(net.secret),
         "--cluster-name", "netns", "--insecure"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "left the cluster" in out.stdout
    leader.procs[-1].popen.wait(30)  # it stops by itself
    assert leader.procs[-1].popen.returncode == 0
    rest = [h for h in hosts if h is not leader]
    # A new leader took over; the standby was promoted to keep three voters.
    wait_for(lambda: one_cluster(rest, 3, 3), 60, "three voters without the one that left")
    assert views(rest)[rest[0].index].leader != lead_id


@pytest.mark.parametrize(
    ("workers", "data_groups"),
    [(1, 2), (2, 2), (2, 0)],
    ids=["one-process", "2-workers", "default-groups"],
)
def test_data_groups_follow_a_discovered_cluster_and_a_late_node(
    net: Net, workers: int, data_groups: int
) -> None:
    """With data groups, nodes that found a cluster by discovery run every
    group with every voter (a founder bootstraps them alone; the others join
    each group as group 0 takes them in), and a node that joins later joins
    every group too (docs/multiraft.md, step 6); the same with the data
    groups in worker processes (step 5: they learn group 0's members and
    addresses from their main process). With the default (0: one per voter)
    the founders decide 3, and the late node, started as a deploy starts it
    (bootstrap_expect counting itself: 4), asks the cluster's leader and
    runs the cluster's 3, not 4, and is never restarted for it."""
    groups = [0, 1, 2] if data_groups else [0, 1, 2, 3]
    extra = ["--data-groups", str(data_groups), "--workers", str(workers)]
    if data_groups:
        extra.append("--no-place-topics")
    hosts = [net.host(i) for i in range(1, 4)]
    for h in hosts:
        h.node(expect=3, extra=extra)

    def every_group_has(voters: int, learners_or_voters: int) -> bool:
        if not one_cluster(hosts, voters, learners_or_voters):
            return False
        for h in hosts:
            st = node_status(h.node_address)
            if st is None or not st.nodes:
                return False
            seen = {g.id: g for g in st.nodes[0].groups}
            if sorted(seen) != groups or any(seen[g].leader == 0 for g in groups):
                return False
            if any(seen[g].role == "leader" for g in groups):
                for g in groups:
                    if seen[g].role == "leader" and (
                        len(seen[g].voters) != voters
                        or len(seen[g].voters) + len(seen[g].learners) != learners_or_voters
                    ):
                        return False
        return True

    wait_for(lambda: every_group_has(3, 3), 120, "three voters in every group")
    late = net.host(4)
    late_node = late.node(expect=3 if data_groups else 4, extra=extra)
    hosts.append(late)
    wait_for(lambda: every_group_has(3, 4), 120, "the late node in every group")
    assert late_node.popen.poll() is None  # the first process: never restarted
