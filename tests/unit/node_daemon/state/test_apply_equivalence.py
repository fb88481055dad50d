"""StateMachine.apply against the append it replaced (``machine_reference``):
random runs of creates, appends (merged publishes, idempotent producers,
retries, stale sequences, malformed ops), trims, deletes and re-creates,
snapshots installed and failed transactions leave byte-identical state
(``digest``) and, where results are wanted, identical results; with
``results=False`` (a follower's apply) the state is the same and no result
is built. Also the node's hand-framed Command bytes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.replica.commands import command_bytes
from node_daemon.state.machine import StateMachine
from node_daemon.work.appends import prepare_appends
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.geo import Region, bbox_region
from roadlog.v1 import client_pb2, command_pb2, pings_pb2, topics_pb2
from tests.unit.node_daemon.state.machine_reference import ReferenceStateMachine

pytestmark = pytest.mark.unit

T0 = 1_800_000_000_000
REGION = bbox_region(11.4, 48.05, 11.75, 48.25)
TOPICS = {"munich": 4, "tiny": 1, "wide": 9}


def lookup(name: str) -> tuple[int, Region]:
    if name not in TOPICS:
        raise RoadlogError(Code.NOT_FOUND, name)
    return TOPICS[name], REGION


def create(name: str, retention_ms: int = 0) -> command_pb2.Op:
    spec = topics_pb2.TopicSpec(
        name=name,
        region_geojson=REGION.geojson,
        partitions=TOPICS.get(name, 2),
        retention_ms=retention_ms,
    )
    return command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))


def publish(rng: np.random.Generator, topic: str, producer: int, seq: int, now: int) -> bytes:
    n = int(rng.integers(1, 60))
    ids = [f"car-{int(i)}" for i in rng.integers(0, 30, size=int(rng.integers(1, 8)))]
    cols = PingColumns.from_columns(
        [ids[int(i)] for i in rng.integers(0, len(ids), size=n)],
        np.full(n, now),
        48.1 + rng.random(n) * 0.1,
        11.5 + rng.random(n) * 0.1,
    )
    return client_pb2.PublishRequest(
        topic=topic,
        client_id=f"client-{producer % 3}",
        producer_id=producer,
        sequence=seq,
        batch=pings_pb2.PingBatch.FromString(columnar.encode(cols)),
    ).SerializeToString()


def random_ops(
    rng: np.random.Generator, state: dict[str, Any], now: int, plain: bool = False
) -> list[command_pb2.Op]:
    """Ops of one entry; ``plain``: publishes without idempotent producers."""
    r = rng.random()
    if r < 0.05:
        return [command_pb2.Op(trim=command_pb2.TrimOp())]
    if r < 0.08:
        name = str(rng.choice(list(TOPICS)))
        return [command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name=name))]
    if r < 0.14:
        name = str(rng.choice(list(TOPICS)))
        return [create(name, int(rng.choice([0, 3_000, 60_000])))]
    if r < 0.17:  # malformed appends: every replica refuses them alike
        op = command_pb2.Op()
        op.append.topic = str(rng.choice(["munich", "nope", "Bad Name"]))
        if rng.random() < 0.5:
            op.append.parts.add(partition=int(rng.integers(0, 12)), batch=b"", count=1)
        if rng.random() < 0.7:
            op.append.spans.add(counts=[int(c) for c in rng.integers(0, 2, size=2)])
        return [op]
    requests = []
    for _ in range(int(rng.integers(1, 12))):
        producer = 0 if plain else int(rng.integers(0, 4))
        seqs = state.setdefault("seq", {})
        k = rng.random()
        if producer and k < 0.15 and seqs.get(producer):
            seq = seqs[producer]  # a retry of the last one
        elif producer and k < 0.2 and seqs.get(producer, 0) > 9:
            seq = seqs[producer] - 9  # older than what is remembered
        else:
            seq = seqs[producer] = seqs.get(producer, 0) + 1
        topic = "munich" if rng.random() < 0.7 else str(rng.choice(list(TOPICS)))
        requests.append(publish(rng, topic, producer, seq, now))
        if rng.random() < 0.05:
            requests.append(requests[-1])  # the same publish twice in one op
    prepared, _ = prepare_appends(requests, lookup, now)
    return [p.op for p in prepared]


class Failing(Exception):
    pass


@pytest.mark.parametrize("plain", [False, True], ids=["producers", "plain"])
@pytest.mark.parametrize("seed", range(12))
def test_apply_matches_the_old_append(seed: int, plain: bool, tmp_path: Path) -> None:
    """Also: wherever ``answers`` can tell an apply's results before it, it
    tells exactly what that apply answers (``plain``: runs in which it
    mostly can)."""
    rng = np.random.default_rng(seed)
    ref = ReferenceStateMachine(tmp_path / "ref", map_size=64 << 20)
    new = StateMachine(tmp_path / "new", map_size=64 << 20)
    quiet = StateMachine(tmp_path / "quiet", map_size=64 << 20)
    machines = (ref, new, quiet)
    index, now = 0, T0
    state: dict[str, Any] = {}
    # Producer ids 1-3, issued the way entries from before random ids did
    # (a counter), which both machines apply alike.
    issue = command_pb2.Op(init_producer=command_pb2.InitProducerOp(client_id="c"))
    first = [create("munich", 5_000), create("tiny"), create("wide"), issue, issue, issue]
    pending: list[list[command_pb2.Op]] = [first]
    saved: tuple[int, dict[str, Any]] | None = None
    told = 0  # steps whose results answers told ahead
    for step in range(60):
        now += int(rng.integers(0, 2_000))
        pending += [random_ops(rng, state, now, plain) for _ in range(int(rng.integers(1, 4)))]
        entries = []
        for ops in pending:
            index += 1
            data = command_pb2.Command(leader_ms=now, ops=ops).SerializeToString()
            entries.append(Entry(1, index, EntryType.NORMAL, data))
        pending = []
        if rng.random() < 0.15:  # a transaction that fails part way, on every replica
            failed, at = 0, int(rng.integers(1, 4))
            for sm in machines:
                real = sm.heat.record
                sm.heat.record = _fail_at(at, real)  # type: ignore[method-assign]
                try:
                    sm.apply(entries, sm is not quiet)
                except Failing:
                    failed += 1
                sm.heat.record = real  # type: ignore[method-assign]
            assert failed in (0, len(machines))  # none if fewer appends stored pings
        want = ref.apply(entries)
        early = new.answers(entries)
        if early is not None:
            told += 1
            assert early == want, f"step {step}"
        assert new.apply(entries) == want
        assert quiet.apply(entries, results=False) == [[] for _ in entries]
        digest = ref.digest()
        assert new.digest() == digest, f"step {step}"
        assert quiet.digest() == digest, f"step {step}"
        if saved is None and rng.random() < 0.1:
            for k, sm in enumerate(machines):
                sm.write_snapshot(tmp_path / f"snap{k}")
            saved = (index, {"seq": dict(state.get("seq", {}))})
        elif saved is not None and rng.random() < 0.2:
            # Back to the snapshot: what the appends since then remembered is stale.
            for k, sm in enumerate(machines):
                sm.install_snapshot(tmp_path / f"snap{k}")
            index, state = saved[0], saved[1]
            saved = None
    for sm in machines:
        sm.close()
    if plain:
        assert told >= 3  # the check above ran, not only the fallback


def _fail_at(call: int, real: Callable[..., None]) -> Callable[..., None]:
    """``real``, except that its ``call``-th call raises Failing."""
    calls = 0

    def record(*args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == call:
            raise Failing()
        real(*args)

    return record


@pytest.mark.parametrize("leader_ms", [0, 1, 127, 128, T0, -1, -(1 << 40)])
def test_command_bytes_are_what_protobuf_writes(leader_ms: int) -> None:
    ops = [
        command_pb2.Op(trim=command_pb2.TrimOp()),
        create("munich"),
        command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name="x" * 200)),
    ]
    prepared, _ = prepare_appends(
        [publish(np.random.default_rng(1), "munich", 1, 1, T0)], lookup, T0
    )
    ops.append(prepared[0].op)
    for k in range(len(ops) + 1):
        want = command_pb2.Command(leader_ms=leader_ms, ops=ops[:k]).SerializeToString()
        assert command_bytes(leader_ms, [op.SerializeToString() for op in ops[:k]]) == want
