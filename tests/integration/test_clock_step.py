"""Give-to-get across a stepped wall clock (issue 21, found by the nemesis:
seed 3, 60 s). A contribution is stamped with the leader's clock when it
is applied; the rule compared it with the reading node's wall clock. So
a leader whose clock ran three hours behind stamped contributions three
hours old, and once its clock was set right (or any node with a true
clock answered) a client that had published a second before was refused
its heat map. Both sides must be on the log's own clock.

One node, so that the leader stamps and answers: its wall clock is
stepped through ``tests.nemesis.clockshim``, as the nemesis does.
"""

from __future__ import annotations

import contextlib
import email.utils
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from roadlog.client import Admin, Connection, PermissionDenied, Producer
from roadlog.tools.localcluster import LocalCluster, NodeInfo
from roadlog.v1 import heatmaps_pb2
from tests.certs import ClusterCA
from tests.integration.conftest import REGION, make_pings, wait_for
from tests.integration.test_transfer_leader import transfer

pytestmark = pytest.mark.integration

HOURS_3 = 3 * 3600


@pytest.fixture
def one_node_with_a_clock(
    tmp_path: Path, test_ca: ClusterCA
) -> Iterator[tuple[LocalCluster, Path]]:
    lc = LocalCluster.create(tmp_path / "c", nodes=1, queue_servers=1, ca=test_ca.signing)
    clock = tmp_path / "clock"
    clock.write_text("0\n")
    (node,) = lc.nodes
    _on_a_clock(node, clock)
    lc.start_all()
    try:
        lc.wait_ready(60)
        yield lc, clock
    finally:
        lc.down(grace=1)


def _on_a_clock(node: NodeInfo, clock: Path) -> None:
    """Run ``node`` with its wall clock offset by what ``clock`` says
    (``tests.nemesis.clockshim``, as the nemesis does)."""
    assert node.argv[1:3] == ["-m", "node_daemon.process.main"]
    node.argv = [node.argv[0], "-m", "tests.nemesis.clockshim", str(clock), *node.argv[2:]]


@contextlib.contextmanager
def contributors(lc: LocalCluster, *names: str) -> Iterator[list[Connection]]:
    """The topic munich (with a heat map to ask for), and a connection of
    each named identity, which may publish to it and ask for its heat maps."""
    with Connection(lc.servers, tls=lc.tls(), timeout=30) as conn:
        admin = Admin(conn)
        # The clocks, not give-to-get's minimum run, are what these look at:
        # one batch counts as a contribution here (a span of 0 s).
        admin.create_topic("munich", REGION, 2, contribution_min_pings=1,
                           contribution_min_seconds=0)  # fmt: skip
        admin.put_heatmap(heatmaps_pb2.HeatMap(topic="munich", window_start_ms=1, window_end_ms=2))
        tokens = [admin.create_client(n, ["produce:munich", "heatmap:munich"]).token for n in names]
    conns = [Connection(lc.servers, tls=lc.tls().with_token(t), timeout=30) for t in tokens]
    try:
        yield conns
    finally:
        for c in conns:
            c.close()


def test_a_contributor_is_not_refused_because_the_leader_s_clock_was_stepped(
    one_node_with_a_clock: tuple[LocalCluster, Path],
) -> None:
    lc, clock = one_node_with_a_clock
    with contributors(lc, "c", "probe") as (conn, probe):
        admin = Admin(conn)
        producer = Producer(conn, "munich")
        producer.send_batch(make_pings("c", 0, 10))
        true_stamp = admin.heatmap("munich").contributed_ms

        # The leader's clock three hours behind: what it stamps now.
        clock.write_text(f"{-HOURS_3}\n")
        sent = [10]

        def stamped_behind() -> bool:
            producer.send_batch(make_pings("c", sent[0], 10))
            sent[0] += 10
            return admin.heatmap("munich").contributed_ms < true_stamp - 3_600_000

        # (On the log's clock nothing is stamped behind: then this times out.)
        with contextlib.suppress(AssertionError):
            wait_for(stamped_behind, 3, "a contribution stamped on the stepped clock")
        # The clock set right again; c published a moment ago and asks.
        clock.write_text("0\n")
        wait_for(lambda: _clock_true(Admin(probe), sent), 10, "the clock read true again")
        try:
            admin.heatmap("munich")
        except PermissionDenied as e:
            pytest.fail(f"a client that published a moment ago was refused: {e.message}")


def test_a_contributor_is_not_refused_because_the_leader_s_clock_jumped_ahead(
    one_node_with_a_clock: tuple[LocalCluster, Path],
) -> None:
    """The leader's clock stepped 3 h ahead (issue 21, nemesis finding 4):
    had the log's clock followed it (an entry's leader_ms is all the log
    knows of time), a contribution made a second before the step would
    look 3 h old and its client be refused until it published again. The
    leader stamps its entries with its wall clock bounded by the monotonic
    time since its last stamp (node_daemon/replica/log_clock.py), so a step of its
    wall clock is not a jump of the log's."""
    lc, clock = one_node_with_a_clock
    with contributors(lc, "c", "d") as (conn, d):
        admin = Admin(conn)
        Producer(conn, "munich").send_batch(make_pings("c", 0, 10))
        before = admin.heatmap("munich").contributed_ms
        clock.write_text(f"{HOURS_3}\n")
        # The node reads its wall clock stepped now (its HTTP Date header
        # says so): what it stamps from here on is proposed on that clock.
        (node,) = lc.nodes
        wait_for(
            lambda: (
                _node_wall_clock_ms(lc.metrics_url(node, "/healthz"))
                > time.time() * 1000 + 3_600_000
            ),
            10,
            "the node's wall clock stepped ahead",
        )
        _stamped_on_the_log_clock(admin, d, before, "the leader stamped its stepped wall clock")


@pytest.fixture
def three_nodes_with_clocks_and_boots(
    tmp_path: Path, test_ca: ClusterCA
) -> Iterator[tuple[LocalCluster, list[Path], list[Path]]]:
    """Three nodes, each with a wall clock the test steps (as
    ``one_node_with_a_clock``) and a boot id file it can change (a reboot of
    the host, as the nemesis's power cuts). Retention once an hour: nothing
    but what the test does is stamped. One group (every ping in group 0):
    the test needs the rebooted node to lead the group that stamps the
    contribution, and no admin call moves a chosen data group to a chosen
    node (``transfer-leader`` moves group 0 and the data groups its leader
    leads), so on the default layout the stamp could come from another."""
    lc = LocalCluster.create(
        tmp_path / "c",
        nodes=3,
        queue_servers=1,
        ca=test_ca.signing,
        extra_node_args=["--trim-interval-s", "3600"],
        data_groups=1,
    )
    clocks, boots = [], []
    for node in lc.nodes:
        clock, boot = tmp_path / f"clock{node.id}", tmp_path / f"boot{node.id}"
        clock.write_text("0\n")
        boot.write_text("boot-1\n")
        clocks.append(clock)
        boots.append(boot)
        _on_a_clock(node, clock)
        node.argv += ["--boot-id-file", str(boot)]
    lc.save()
    lc.start_all()
    try:
        lc.wait_ready(60)
        yield lc, clocks, boots
    finally:
        lc.down(grace=1)


def test_a_rebooted_leader_does_not_stamp_its_stepped_wall_clock(
    three_nodes_with_clocks_and_boots: tuple[LocalCluster, list[Path], list[Path]],
) -> None:
    """Nemesis finding 21 (seed 53, 1516 s): every node went down; one came
    back on a new boot (no monotonic measure of the log's clock) with its
    wall clock 30 minutes ahead and led before anything was stamped. Its
    first stamp was its wall clock, so clients that had published a minute
    before were refused heat maps. Its voters, killed and started again on
    the same boot, kept their measures: a granted vote carries it."""
    lc, clocks, boots = three_nodes_with_clocks_and_boots
    with contributors(lc, "c", "d") as (conn, d):
        admin = Admin(conn)
        Producer(conn, "munich").send_batch(make_pings("c", 0, 10))
        before = admin.heatmap("munich").contributed_ms
        # Every node has saved its measure of that stamp (log-clock: boot,
        # monotonic time, stamp), as it does at most every second.
        anchors = [Path(n.data_dir) / "log-clock" for n in lc.nodes]
        wait_for(
            lambda: all(_anchor_ms(a) >= before for a in anchors), 10, "every node's measure saved"
        )
        # The whole cluster down (stopped cleanly: the state synced, so that
        # the rebooted node applies no entry again as it starts, which would
        # teach it a stamp and a measure, a stale one).
        for node in lc.nodes:
            lc.kill(node.id, signal.SIGTERM)
        rebooted = lc.nodes[0]
        boots[0].write_text("boot-2\n")  # its host booted again ...
        clocks[0].write_text(f"{HOURS_3}\n")  # ... onto a clock 3 h ahead
        for node in lc.nodes:
            lc.start(node.id)
        lc.wait_ready(60)
        if lc.status()["leader"] != rebooted.id:
            r = transfer(lc, "--to", str(rebooted.id))
            assert r.returncode == 0, r.stderr
        wait_for(lambda: lc.status()["leader"] == rebooted.id, 20, "the rebooted node leads")
        _stamped_on_the_log_clock(  # its first stamp
            admin, d, before, "the rebooted leader stamped its stepped wall clock"
        )


def _stamped_on_the_log_clock(c: Admin, d: Connection, before: int, what: str) -> None:
    """d publishes now: its contribution is stamped within an hour of
    ``before`` (c's, seconds ago), and c, who published seconds ago, is
    not refused its heat map."""
    Producer(d, "munich").send_batch(make_pings("d", 0, 1))
    stamped = Admin(d).heatmap("munich").contributed_ms
    assert stamped < before + 3_600_000, what
    try:
        c.heatmap("munich")
    except PermissionDenied as e:
        pytest.fail(f"a client that published seconds ago was refused: {e.message}")


def _anchor_ms(path: Path) -> int:
    """The stamp a node's saved measure holds (0: none yet)."""
    try:
        return int(path.read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 0


def _node_wall_clock_ms(healthz: str) -> float:
    """The node's wall clock, as the Date header of its /healthz says."""
    with urllib.request.urlopen(healthz, timeout=5) as r:
        date: str = r.headers["Date"]
    return email.utils.parsedate_to_datetime(date).timestamp() * 1000


def _clock_true(probe: Admin, sent: list[int]) -> bool:
    """The node's clock is true again: another identity's publish is
    stamped within an hour of now (another one, so c's stamp stays)."""
    cols = make_pings("probe", sent[0], 1)
    sent[0] += 1
    Producer(probe.conn, "munich").send_batch(cols)
    stamp = probe.heatmap("munich").contributed_ms
    return abs(stamp - time.time() * 1000) < 3_600_000
