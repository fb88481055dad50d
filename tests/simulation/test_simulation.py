"""The simulation tier: hundreds of seeds, each a random but reproducible
history of faults, with the Raft invariants, the queue's items, every
read's fence and every acknowledged write checked (see harness.py and
front.py for what is checked when); and for each kind of bug those checks
are there for, a broken copy of the code that the simulator must catch.

Each seed runs once in the tier (the chunks); the other tests run only the
seeds they need: the ones that check a bug is caught stop at the first
seed that catches it, and those that need the real state machine take its
cheaper seeds (from REAL_SEEDS)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import pytest

from node_daemon.raft import Entry, Message
from tests.simulation.harness import (
    Options,
    Result,
    Simulation,
    options_of,
    replay_command,
    run_seed,
)
from tests.simulation.run import main as run_main
from tests.simulation.run import run_seeds

pytestmark = pytest.mark.simulation

SEEDS_PER_CHUNK = 50
CHUNKS = 12  # 600 seeds in the suite
# Seeds on the real state machine (and LMDB) for the tests that need it:
# not seed 0, which alone costs as much as a dozen others.
REAL_SEEDS = [s for s in range(16, 256) if options_of(s).real_sm]


def first_caught(seeds: Iterable[int], caught: Callable[[Result], bool]) -> Result | None:
    """Run ``seeds`` in order up to the first that failed in a way that
    ``caught`` says found the bug (as running them all and looking for one,
    without the rest)."""
    for s in seeds:
        r = run_seed(s)
        if not r.ok and caught(r):
            return r
    return None


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_seeds_hold_every_invariant(chunk: int) -> None:
    seeds = range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK)
    results = list(run_seeds(seeds, jobs=2))
    failures = [f"{r.message}\n  replay: {replay_command(r.seed)}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)
    # The runs did real work: writes acknowledged and applied everywhere,
    # clients' writes acknowledged through the queue and reads answered.
    assert sum(r.acked for r in results) > 0
    assert all(r.applied > 0 for r in results)
    assert sum(r.writes for r in results) > 0 and sum(r.fetches for r in results) > 0
    # Some seeds ran on LMDB with the real state machine, and did as much.
    real = [r for r in results if options_of(r.seed).real_sm]
    assert real and all(options_of(r.seed).lmdb for r in real)
    assert sum(r.acked for r in real) > 0 and sum(r.writes for r in real) > 0


def test_faults_are_exercised_across_seeds() -> None:
    results = list(run_seeds(range(10_000, 10_080), jobs=2))
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    assert sum(r.crashes for r in results) > 0
    assert sum(r.snapshots for r in results) > 0
    assert sum(r.conf_changes for r in results) > 0
    assert sum(r.reads for r in results) > 0


def test_a_share_of_seeds_runs_on_real_lmdb() -> None:
    """One seed in eight keeps its Raft log in LMDB files (the chunks run
    them); a simulation built and not run leaves no files behind."""
    from node_daemon.storage.raft_log import LmdbLogStorage

    lmdb_seeds = [s for s in range(64) if options_of(s).lmdb]
    assert 4 <= len(lmdb_seeds) <= 16
    sim = Simulation(lmdb_seeds[0])
    assert sim.tmp is not None
    assert all(isinstance(n.storage, LmdbLogStorage) for n in sim.nodes.values())
    sim.close()
    assert not sim.tmp.exists()


def test_a_seed_replays_identically() -> None:
    a, b = run_seed(1234), run_seed(1234)
    assert a == b


def elects_stale_leaders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the core: no election restriction (§5.4.1)."""
    from node_daemon.raft.log import RaftLog

    monkeypatch.setattr(RaftLog, "is_up_to_date", lambda self, last_index, term: True)


def test_a_broken_core_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the election restriction (§5.4.1) the checker finds violations."""
    elects_stale_leaders(monkeypatch)
    found = first_caught(
        range(60), lambda r: "leader completeness" in r.message or "safety" in r.message
    )
    assert found, "the simulator did not notice a core that elects stale leaders"


# Seeds on which a leader that counts its own entries before they are on its
# disk loses a committed entry (found by running 1,000 seeds on that bug,
# before the simulated clients: they run without them, so with the history
# those seeds had then).
SELF_ACK_SEEDS = [57, 121, 373, 458, 664]


def test_a_leader_counting_unpersisted_entries_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader may send appends before its own write is durable only
    because it counts itself after the write; break that and the simulator,
    which steps messages while a write is in flight, must notice."""
    from node_daemon.raft.core import RaftCore

    original = RaftCore._append

    def counting_too_early(self: RaftCore, ents: list[Entry]) -> int:
        first = original(self, ents)
        me = self.prs.get(self.id)
        if me is not None:
            me.maybe_update(self.log.last_index())
            self._maybe_commit()
        return first

    monkeypatch.setattr(RaftCore, "_append", counting_too_early)
    bad = [r for r in (Simulation(s, clients=False).run() for s in SELF_ACK_SEEDS) if not r.ok]
    assert bad, "the simulator did not notice a leader acknowledging its own unpersisted entries"


def test_runner_prints_the_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(["--seeds", "6", "--start", "40", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "simulated 6 seeds: 0 violations"


def test_runner_reports_a_violation_with_its_replay_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    elects_stale_leaders(monkeypatch)
    found = first_caught(range(40), lambda r: True)
    assert found is not None
    capsys.readouterr()
    code = run_main(["--seeds", "2", "--start", str(found.seed), "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"replay: make sim SEEDS=1 START={found.seed}" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("simulated 2 seeds: ") and not last.endswith(" 0 violations")


def test_options_come_from_the_seed() -> None:
    import random

    assert Options.from_seed(7, random.Random(7)) == Options.from_seed(7, random.Random(7))


def test_a_share_of_seeds_runs_the_real_state_machine() -> None:
    """On the LMDB seeds the node's own StateMachine applies real commands:
    the run checks what each client was told and, at the end, that every
    replica's state has the same digest and holds every acknowledged write."""
    from tests.simulation.harness import RealStateMachine

    seeds = [s for s in range(64) if options_of(s).real_sm]
    assert 4 <= len(seeds) <= 16
    sim = Simulation(REAL_SEEDS[0])
    assert all(isinstance(n.sm, RealStateMachine) for n in sim.nodes.values())
    results = [sim.run(), *map(run_seed, REAL_SEEDS[1:3])]
    assert all(r.ok for r in results), [r.message for r in results]
    assert sum(r.acked for r in results) > 0 and sum(r.writes for r in results) > 0


def test_a_nondeterministic_state_machine_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state machine whose replicas store different bytes for the same
    entries (here: a creation time that is not the leader's) is found by
    the end-of-run digest of the real state."""
    import itertools
    from typing import Any

    from node_daemon.state.topics import TopicTables

    original = TopicTables.create
    clock = itertools.count()

    def local_time(self: TopicTables, txn: Any, spec: Any, leader_ms: int, *rest: Any) -> Any:
        return original(self, txn, spec, leader_ms + next(clock), *rest)

    monkeypatch.setattr(TopicTables, "create", local_time)
    bad = [r for r in map(run_seed, REAL_SEEDS[:3]) if not r.ok]
    assert bad, "the simulator did not notice replicas whose state differs"
    assert all("state differs" in r.message for r in bad), [r.message for r in bad]


def test_clients_write_and_read_through_the_real_work_queues() -> None:
    """Clients' writes and fenced reads go through a real WorkQueues to the
    nodes as workers; some are sent again after a failure, every run
    acknowledges some writes, and reads are answered on both kinds of state
    machine (each checked: it holds the writes acknowledged up to its fence)."""
    from tests.simulation.front import Front

    sim = Simulation(3)
    assert isinstance(sim.front, Front) and len(sim.front.q.workers) == sim.opts.n_nodes
    results = [sim.run(), *map(run_seed, range(4, 24))]
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    assert all(r.writes > 0 for r in results)
    assert sum(r.resent for r in results) > 0
    assert sum(r.refetched for r in results) > 0
    real = {s for s in range(3, 24) if options_of(s).real_sm}
    assert sum(r.fetches for r in results if r.seed in real) > 0
    assert sum(r.fetches for r in results if r.seed not in real) > 0


def test_a_read_served_below_its_fence_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes that tell the queue they applied more than they did and serve
    a read without waiting for its fence answer reads that miss writes
    acknowledged at or below it: the read-your-writes check finds them."""
    from queue_server.queues import WorkQueues
    from tests.simulation.front import Front

    update = WorkQueues.update

    def boasting(self: WorkQueues, worker_id: int, leader: bool, term: int, applied: int) -> None:
        update(self, worker_id, leader, term, applied + 1_000_000)

    monkeypatch.setattr(WorkQueues, "update", boasting)
    monkeypatch.setattr(Front, "fence_reached", lambda self, node, it: True)
    bad = [r for r in map(run_seed, range(10, 22)) if not r.ok]
    assert bad, "the simulator did not notice reads served below their fence"
    # Each a read below its fence: missing a write, or missing the topic.
    assert all(
        "lacks write" in r.message or re.search(r"fenced at \d+ answered .*NOT_FOUND", r.message)
        for r in bad
    ), [r.message for r in bad]


def test_a_queue_ignoring_read_fences_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue that hands a read to a node that has not applied its fence
    is caught when it hands it out."""
    from queue_server.queues import Item, Worker, WorkQueues

    def any_reader(self: WorkQueues, it: Item) -> Worker | None:
        return next((w for w in self.workers.values() if w.read_credit > 0), None)

    monkeypatch.setattr(WorkQueues, "_can_read", lambda self, it: any_reader(self, it) is not None)
    monkeypatch.setattr(WorkQueues, "_reader_for", any_reader)
    bad = [r for r in map(run_seed, range(3, 12)) if not r.ok]
    assert bad, "the simulator did not notice a read handed out below its fence"
    assert all("handed to node" in r.message for r in bad), [r.message for r in bad]


def test_a_queue_losing_a_crashed_workers_items_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queue that forgets what a crashed worker held (instead of handing
    it back) is caught by the after-every-operation item check."""
    from queue_server.queues import Item, WorkQueues

    def forgetful(self: WorkQueues, worker_id: int, now: float) -> list[Item]:
        self.workers.pop(worker_id, None)
        return []

    monkeypatch.setattr(WorkQueues, "disconnect", forgetful)
    bad = [r for r in map(run_seed, range(12)) if not r.ok]
    assert bad, "the simulator did not notice a queue losing items"
    assert all("is lost" in r.message for r in bad), [r.message for r in bad]


def test_a_state_machine_storing_a_retry_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the producer (id, sequence) check a write handed out again
    (its leader lost leadership after the entry was in the log) or sent
    again by its client is stored twice: the end-of-run read-back finds it."""
    from typing import Any

    from node_daemon.state import producers

    def never(*args: Any) -> None:
        return None

    monkeypatch.setattr(producers, "_duplicate", never)
    bad = [r for r in map(run_seed, REAL_SEEDS[:4]) if not r.ok]
    assert bad, "the simulator did not notice a retried write stored twice"
    assert all("more than once" in r.message for r in bad), [r.message for r in bad]


def test_a_toy_state_machine_storing_a_retry_twice_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The toy state machine dedupes a resent (producer, sequence) as the
    node's does; without that, the end-of-run check on toy replicas finds
    writes stored twice."""
    from tests.simulation.harness import StateMachine

    monkeypatch.setattr(StateMachine, "_duplicate", lambda self, seen, seq: None)
    seeds = [s for s in range(1, 12) if not options_of(s).real_sm][:6]
    bad = [r for r in map(run_seed, seeds) if not r.ok]
    assert bad, "the simulator did not notice a toy replica storing a retry twice"
    assert all("more than once" in r.message for r in bad), [r.message for r in bad]


MULTI_GROUP_SEEDS = [s for s in range(400) if options_of(s).groups > 1]


def test_several_groups_on_the_same_nodes_hold_every_invariant() -> None:
    """Seeds with data groups beside group 0 (docs/multiraft.md): each
    group's invariants hold, each converges with its acknowledged writes,
    crashes take every group of a node down at once, and one node leads
    several groups at a time in some of them."""
    assert 0.15 <= len(MULTI_GROUP_SEEDS) / 400 <= 0.35
    results = list(run_seeds(MULTI_GROUP_SEEDS[:40], jobs=2))
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    assert all(r.data_groups == 2 for r in results)
    assert sum(r.data_acked for r in results) > 0
    assert sum(r.data_writes for r in results) > 0  # clients' writes in the data groups
    assert sum(r.crashes for r in results) > 0
    assert sum(1 for r in results if r.multi_led) > 0


def test_a_crash_takes_every_group_of_the_node_down() -> None:
    sim = Simulation(MULTI_GROUP_SEEDS[0], clients=False)
    try:
        victim = sim.nodes[1]
        sim.crash(victim)
        assert victim.core is None
        assert all(dg.nodes[1].core is None for dg in sim.data)
        sim._restart(1)
        assert victim.core is not None and all(dg.nodes[1].core is not None for dg in sim.data)
    finally:
        sim.close()


def test_messages_routed_to_the_wrong_group_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the routing by group (every data group's messages reach group
    1's replicas): the run must notice, by a group's invariant or by a
    group that never converges (group 2 hears nothing)."""
    from tests.simulation.harness import GroupNet, Network

    def misrouted(self: GroupNet, m: Message) -> None:
        Network.send(self.net, m, 1)

    monkeypatch.setattr(GroupNet, "send", misrouted)
    found = first_caught(
        MULTI_GROUP_SEEDS[:40], lambda r: "group " in r.message or "g2:" in r.message
    )
    assert found, "the simulator did not notice messages delivered to another group"


def test_a_data_group_storing_a_retry_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The data groups' clients are checked as group 0's: a replica storing
    a resent write twice is found in a data group (its checker's label)."""
    from tests.simulation.harness import StateMachine

    monkeypatch.setattr(StateMachine, "_duplicate", lambda self, seen, seq: None)
    seeds = [s for s in MULTI_GROUP_SEEDS if not options_of(s).real_sm][:8]
    bad = [r for r in map(run_seed, seeds) if not r.ok]
    assert any("group 1" in r.message or "group 2" in r.message for r in bad), [
        r.message for r in bad
    ]


# ------------------------------------------------ publishes split across groups

SPLIT_SEEDS = MULTI_GROUP_SEEDS[:24]


def test_split_publishes_are_acknowledged_once_every_part_is() -> None:
    """Seeds with data groups run split clients (split.py): publishes over
    several groups go through group 0's leader, which answers with parts,
    each handed to its group's leader; some are acknowledged, some retried
    after an unknown outcome, some refused for sure; every check holds."""
    results = list(run_seeds(SPLIT_SEEDS, jobs=2))
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    assert sum(r.split_acked for r in results) > 0
    assert sum(r.split_resent for r in results) > 0
    assert sum(r.split_refused for r in results) > 0
    assert sum(r.split_parts for r in results) > sum(r.split_acked for r in results)
    # Seeds without data groups have no split clients.
    assert run_seed(0).split_parts == 0
    # The consumers of the split topic (consumers.py) ran in the same seeds:
    # offsets committed through group 0, on the toy and the real state
    # machine, some judged again after a ReadIndex of their data group, some
    # (committed ahead of what was read) refused as past the end.
    assert sum(r.offset_commits for r in results) > 0
    assert sum(r.offset_commits for r in results if options_of(r.seed).real_sm) > 0
    assert sum(r.offset_read_index for r in results) > 0
    assert sum(r.offset_refused for r in results) > 0


def test_the_split_checker_reports_each_kind_of_violation() -> None:
    """``split_violations`` fed histories that break each guarantee."""
    from tests.simulation.split import SplitHistory, split_violations

    groups = [1, 2, 1, 2]  # partition -> group

    def history() -> SplitHistory:
        h = SplitHistory(groups)
        h.sent = {(7, 1): [0, 1], (7, 2): [1, 3], (7, 3): [2]}
        h.acked = {(7, 1): {0: 0, 1: 0}}
        return h

    good = {1: {0: [(7, 1)], 2: [(7, 3)]}, 2: {1: [(7, 1), (7, 2)], 3: [(7, 2)]}}
    assert split_violations(history(), good) == []
    # (1) acknowledged, but a part is missing in its group, or at another offset.
    lost = {1: {0: [(7, 1)]}, 2: {1: [(7, 2)], 3: [(7, 2)]}}
    [msg] = split_violations(history(), lost)
    assert "acknowledged split publish (7, 1) lacks its part in group 2" in msg
    moved = {1: {0: [(7, 1)]}, 2: {1: [(7, 2), (7, 1)]}}
    assert any("its answer said 0" in m for m in split_violations(history(), moved))
    # (2) a retry stored again in one group.
    twice = {1: {0: [(7, 1)]}, 2: {1: [(7, 1), (7, 2), (7, 2)], 3: [(7, 2)]}}
    [msg] = split_violations(history(), twice)
    assert "(7, 2) stored more than once in partition 1" in msg
    # (3) a publish refused for sure, part of it stored; or one acknowledged.
    h = history()
    h.refused.add((7, 3))
    [msg] = split_violations(h, good)
    assert "(7, 3) was refused for sure" in msg
    h = history()
    h.bad.add((7, 1))
    assert any("acknowledged, yet it has a ping to refuse" in m for m in split_violations(h, good))
    # And a part in a group the map does not give it, or never sent.
    stray = {1: {0: [(7, 1)], 1: [(9, 9)]}, 2: {1: [(7, 1)]}}
    msgs = split_violations(history(), stray)
    assert any("partition 1 stored in group 1" in m for m in msgs)
    assert any("(9, 9) stored but never sent" in m for m in msgs)


def test_a_merge_that_acknowledges_a_failed_part_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Break the queue server's merge (queue_server/parts.py) so that a
    part's failure is left out of the client's answer: a publish is
    acknowledged though one of its parts was not stored."""
    from queue_server import parts

    take = parts._take

    from typing import Any

    def ignoring_failures(answers: Any, part: Any, result: Any) -> None:
        if not result.code:
            take(answers, part, result)

    monkeypatch.setattr(parts, "_take", ignoring_failures)
    found = first_caught(SPLIT_SEEDS, lambda r: "acknowledged without its part" in r.message)
    assert found, "the simulator did not notice a publish acknowledged without all its parts"


def test_a_split_retry_stored_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the (producer, sequence) check in the data groups, a split
    publish retried after an unknown outcome is stored again in a group
    that had stored its part: the split checker finds it."""
    from tests.simulation.harness import StateMachine

    monkeypatch.setattr(StateMachine, "_duplicate", lambda self, seen, seq: None)
    seeds = [s for s in SPLIT_SEEDS if not options_of(s).real_sm]
    found = first_caught(seeds, lambda r: "split publish" in r.message)
    assert found, "the simulator did not notice a split publish stored twice"
    assert "more than once" in found.message


def test_a_split_publish_that_must_fail_acknowledged_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Group 0's leader that does not validate before splitting stores and
    acknowledges a publish that must be refused (a ping outside the region)."""
    from roadlog import validation

    monkeypatch.setattr(validation, "check_batch", lambda cols, region, now_ms: None)
    found = first_caught(SPLIT_SEEDS, lambda r: "ping to refuse" in r.message)
    assert found, "the simulator did not notice an invalid split publish acknowledged"


# ------------------------------------------- consumer offsets and committed data


def test_the_offset_checker_reports_each_kind_of_violation() -> None:
    """``offset_violations`` fed histories that break "consumer offsets
    never ahead of committed data"."""
    from tests.simulation.consumers import Commit, OffsetHistory, offset_violations

    def history() -> OffsetHistory:
        h = OffsetHistory([1, 2, 1, 2])
        h.sent = {
            (1, 1): Commit("cg1", 0, 3, honest=True),
            (1, 2): Commit("cg1", 1, 5, honest=False),
            (2, 1): Commit("cg2", 0, 2, honest=True),
        }
        h.acked = {(1, 1): 3, (2, 1): 4}  # each commit's partition's committed end then
        h.refused = {(1, 2)}  # committed ahead of what was read: refused
        return h

    stored = {"cg1": {0: 3}, "cg2": {0: 2}}
    ends = {0: 3, 1: 0, 2: 0, 3: 0}
    assert offset_violations(history(), stored, ends) == []
    # Acknowledged past the end its data group had committed then.
    h = history()
    h.acked[(1, 1)] = 2
    [msg] = offset_violations(h)
    assert "commit (1, 1) of cg1 acknowledged at offset 3 of partition 0" in msg
    assert "committed only up to 2" in msg
    assert offset_violations(h, only=(2, 1)) == []  # one commit alone
    # A commit of what a replica served, refused as past the end.
    h = history()
    h.refused.add((2, 1))
    assert any("(2, 1) of cg2 refused as past the end" in m for m in offset_violations(h))
    # At the end: a stored offset ahead of the converged data group, or never sent.
    [msg] = offset_violations(history(), {"cg1": {0: 3}, "cg2": {0: 2}}, {**ends, 0: 2})
    assert "cg1's committed offset 3 of partition 0 is ahead of what its data group 1" in msg
    msgs = offset_violations(history(), {"cg1": {0: 3, 2: 0}}, ends)
    assert msgs == ["cg1's committed offset 0 of partition 2 was never sent"]


def test_a_leader_that_does_not_judge_commits_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 0's leader that proposes a consumer's commit without judging
    it against the partition's data group (``_within_data_groups``) stores
    an offset a consumer committed ahead of what it read, past what the
    group committed: caught when the commit is acknowledged."""
    from tests.simulation.consumers import ConsumerFront

    monkeypatch.setattr(ConsumerFront, "judged", False)
    found = first_caught(SPLIT_SEEDS, lambda r: "committed only up to" in r.message)
    assert found, "the simulator did not notice a consumer offset ahead of committed data"


# Seeds in which a commit of what a replica served reaches a group 0
# leader whose replica of the data group lags that one (found by running
# seeds 0-399 with ``linearizable`` off: 88, 120, 138, 214, 258, 264, 398).
LAGGING_JUDGE_SEEDS = [138, 88, 398]


def test_a_leader_judging_on_its_lagging_replica_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Judged on the leader's own replica of the data group as it is (no
    catch-up, no ReadIndex), a commit of what a further replica served is
    refused as past the end: caught (a ReadIndex covers what any replica
    applied)."""
    from tests.simulation.consumers import ConsumerFront

    monkeypatch.setattr(ConsumerFront, "linearizable", False)
    found = first_caught(LAGGING_JUDGE_SEEDS, lambda r: "refused as past the end" in r.message)
    assert found, "the simulator did not notice a commit within committed data refused"
