"""Operation kinds in a mixed cluster (issue 39): how a node treats a kind
its release does not know (it skips it, so the replicas would diverge), and
the gate (``node_daemon.state.op_gate``) by which a leader proposes a newer
kind only once every member of its group says it applies it."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state.op_gate import (
    FIELDS_LEVEL,
    LEVELS,
    NEWER_FIELDS,
    OP_LEVEL,
    admit,
    everyone_at,
    refusal,
    told_level,
)
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import command_pb2, settings_pb2
from tests.unit.node_daemon.state.applying import T0, Applying

pytestmark = pytest.mark.unit

SET = "set_setting"


def test_every_kind_of_op_has_a_level_and_the_newest_is_this_release() -> None:
    """A kind added to ``Op`` must be given its level (the release that
    first applies it), or this fails."""
    kinds = {f.name for f in command_pb2.Op.DESCRIPTOR.oneofs_by_name["op"].fields}
    assert kinds == set(LEVELS)
    assert OP_LEVEL == max(LEVELS.values()) == 3
    assert {k for k, v in LEVELS.items() if v > 1} == {
        "update_topic",
        "set_setting",
        "register_member",
        "report_load",
        "place_topic_home",
        "forget_topic_home",
        "fence_topic",
        "import_topic",
        "move_topic_home",
    }
    assert {k for k, v in LEVELS.items() if v == 3} == {
        "fence_topic",
        "import_topic",
        "move_topic_home",
    }


def test_a_kind_this_release_does_not_know_is_skipped_by_its_apply(tmp_path: Path) -> None:
    """What an older release does with a newer kind, shown on this one with
    a kind from the future (field 99 of ``Op``: protobuf keeps it aside):
    the entry is answered INVALID_ARGUMENT and nothing is stored, while the
    replicas that know the kind apply it."""
    r, empty = Applying(tmp_path / "a"), Applying(tmp_path / "b")
    future = bytes([0x9A, 0x06, 2, 0x0A, 0x00])  # Op field 99 (a varint tag), 2 bytes
    op = command_pb2.Op.FromString(future)
    assert op.WhichOneof("op") is None
    res = r.apply(op)
    assert res.code == Code.INVALID_ARGUMENT and "unknown operation" in res.message
    nothing = command_pb2.Command(leader_ms=T0).SerializeToString()  # an entry of no ops
    empty.sm.apply([Entry(1, 1, EntryType.NORMAL, nothing)])
    assert r.sm.digest() == empty.sm.digest()  # nothing of it was stored
    # The same cluster setting applied by a release that knows the kind changes the state.
    req = settings_pb2.SetSettingRequest(key="registration_idle_days", value="7")
    r.ok(command_pb2.Op(set_setting=command_pb2.SetSettingOp(request=req)))
    assert r.sm.setting("registration_idle_days") == "7"
    empty.sm.apply([Entry(1, 2, EntryType.NORMAL, nothing)])  # a replica that skipped it
    assert r.sm.digest() != empty.sm.digest()  # diverged: what the gate prevents


def test_a_newer_kind_waits_for_every_member_to_run_a_release_that_applies_it() -> None:
    voters, learners = {1, 2, 3}, {4}
    new = dict.fromkeys((2, 3, 4), OP_LEVEL)
    assert refusal(SET, 1, voters, learners, new) is None
    # n2 still runs the release before (its batches say nothing: 0).
    err = refusal(SET, 1, voters, learners, {**new, 2: 0})
    assert err is not None and err.code == Code.FAILED_PRECONDITION
    assert str(err.message).startswith("cluster mid-upgrade: n2 runs an older release")
    assert "n2, n4 run an older release" in str(
        refusal("update_topic", 1, voters, learners, {**new, 2: 0, 4: 1}).message  # type: ignore[union-attr]
    )
    # A member not heard from (a learner too) is not known: refused, and says so.
    err = refusal(SET, 1, voters, learners, {2: OP_LEVEL, 3: OP_LEVEL})
    assert err is not None and err.code == Code.FAILED_PRECONDITION
    assert "release of n4 is not known" in err.message
    # Alone, or for the first release's kinds, nobody is asked.
    assert refusal(SET, 1, {1}, set(), {}) is None
    for kind in ("append", "create_topic", "trim", "create_client", None):
        assert refusal(kind, 1, voters, learners, {2: 0}) is None
        admit(command_pb2.Op(), kind, 1, voters, learners, {2: 0})
    with pytest.raises(RoadlogError, match="cluster mid-upgrade: n3 runs an older release"):
        admit(command_pb2.Op(), SET, 1, voters, set(), {2: OP_LEVEL, 3: 0})
    # A kind no level names (newer than this release) is refused where anyone else is.
    assert refusal("from_the_future", 1, {1, 2}, set(), {2: OP_LEVEL}) is not None


def test_what_a_batch_says_is_read_as_a_level() -> None:
    assert told_level(0) == 1  # a release from before the field
    assert told_level(1) == 1 and told_level(OP_LEVEL) == OP_LEVEL


def test_newer_fields_of_older_kinds_are_cleared_until_everyone_applies_them() -> None:
    """A trim's idle identities and an InitProducer's quota at apply: an
    older release ignores them, so while a member may run one the leader
    proposes the op without them, and every replica applies it alike."""
    assert everyone_at(FIELDS_LEVEL, 1, {1, 2, 3}, {4}, dict.fromkeys((2, 3, 4), OP_LEVEL))
    assert everyone_at(FIELDS_LEVEL, 1, {1}, set(), {})  # alone
    assert not everyone_at(FIELDS_LEVEL, 1, {1, 2, 3}, set(), {2: OP_LEVEL, 3: 0})
    assert not everyone_at(FIELDS_LEVEL, 1, {1, 2}, {3}, {2: OP_LEVEL})  # n3 not heard from
    assert everyone_at(1, 1, {1, 2}, set(), {2: 0})  # the first release's level: anyone
    for kind, fields in NEWER_FIELDS.items():  # each names a field of its kind's message
        inner = command_pb2.Op.DESCRIPTOR.fields_by_name[kind].message_type
        assert inner is not None
        assert set(fields) <= set(inner.fields_by_name), (kind, fields)

    def ops() -> tuple[command_pb2.Op, command_pb2.Op]:
        trim = command_pb2.TrimOp(
            clients_used=["cl-a"], forget_idle_clients=True, expire_records=True
        )
        init = command_pb2.InitProducerOp(client_id="alice", producer_id=7, bound=True, max_held=8)
        return command_pb2.Op(trim=trim), command_pb2.Op(init_producer=init)

    trim, init = ops()
    mixed = {2: OP_LEVEL, 3: 0}
    admit(trim, "trim", 1, {1, 2, 3}, set(), mixed)
    admit(init, "init_producer", 1, {1, 2, 3}, set(), mixed)
    assert not trim.trim.clients_used and not trim.trim.forget_idle_clients
    assert trim.trim.expire_records  # what the older release applies too stays
    assert init.init_producer.max_held == 0 and init.init_producer.producer_id == 7
    trim, init = ops()
    upgraded = {2: OP_LEVEL, 3: OP_LEVEL}
    admit(trim, "trim", 1, {1, 2, 3}, set(), upgraded)
    admit(init, "init_producer", 1, {1, 2, 3}, set(), upgraded)
    assert list(trim.trim.clients_used) == ["cl-a"] and trim.trim.forget_idle_clients
    assert init.init_producer.max_held == 8
