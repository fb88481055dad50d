"""Which operation kinds each release applies, and the gate that keeps a
leader from proposing one that a member of its group would skip (a mixed
cluster, mid rolling upgrade; issue 39).

How an older release treats an Op kind it does not know: protobuf parses
the entry and keeps the unknown field aside, ``Op.WhichOneof("op")`` is
None, and ``StateMachine._apply_op`` answers INVALID_ARGUMENT ("unknown
operation None") and stores nothing. The entry is committed all the same,
so that replica skips what the others applied (a topic's access fields, a
cluster setting), and the replicas differ from then on: nothing replays it.

The gate: each kind has a level (``LEVELS``), the release that first
applied it; ``OP_LEVEL`` is this release's, the highest it applies. Every
node says its level on every batch of Raft messages it sends
(``RaftBatch.op_level``; a release from before says nothing, 0, read as
level 1: the kinds up to ``place_topic``). The leader proposes a kind of
level L only once every member of the group (voters and learners) is
known at L or above, from what it last said; otherwise FAILED_PRECONDITION
"cluster mid-upgrade: n2 runs an older release". A member not heard from
since this process started is not known, and is refused likewise (it may
come back as anything). Once the upgrade is done, the same call passes.

Newer fields of older kinds (``NEWER_FIELDS``: a trim's idle identities,
an InitProducer's quota at apply) are ignored by an older release alike;
while a member might, the leader clears them before it proposes, so every
replica applies the op as one from before them.

Invariants: a kind missing from ``LEVELS`` is a new one (the test checks
every kind of ``Op`` is listed); levels only grow; an append passes
without looking at anyone, so the write path pays two dict lookups.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from roadlog.errors import Code, RoadlogError
from roadlog.v1 import command_pb2

__all__ = [
    "FIELDS_LEVEL",
    "LEVELS",
    "NEWER_FIELDS",
    "OP_LEVEL",
    "admit",
    "everyone_at",
    "refusal",
    "told_level",
]

# The kinds of the first release, every one of level 1 (the release every
# node of a cluster before issue 39 runs: its RaftBatch has no op_level).
_FIRST = (
    "append", "create_topic", "delete_topic", "init_producer", "trim", "add_peer",
    "join_group", "leave_group", "commit_offsets", "put_heatmap", "delete_group",
    "release_partitions", "create_client", "revoke_client", "place_topic",
)  # fmt: skip
# Level 2: issue 39's kinds, and the federation directory's (issue 43).
_SECOND = (
    "update_topic", "set_setting",
    "register_member", "report_load", "place_topic_home", "forget_topic_home",
)  # fmt: skip
# Level 3: topic moves (issue 43: the source's fence, the target's import,
# the directory's flip).
_THIRD = ("fence_topic", "import_topic", "move_topic_home")
LEVELS: dict[str, int] = {
    **dict.fromkeys(_FIRST, 1),
    **dict.fromkeys(_SECOND, 2),
    **dict.fromkeys(_THIRD, 3),
}
OP_LEVEL = max(LEVELS.values())


# Fields of older kinds that a release before level 2 ignores, and that
# would make its replica differ for good were they acted on: a trim's
# ``clients_used`` and ``forget_idle_clients`` (idle identities forgotten),
# an InitProducer's ``max_held`` (the quota checked at apply). Until every
# member applies them (``everyone_at``), ``admit`` clears them: left unset,
# every release applies the op alike (as entries from before them did).
FIELDS_LEVEL = 2
NEWER_FIELDS: dict[str, tuple[str, ...]] = {
    "trim": ("clients_used", "forget_idle_clients"),
    "init_producer": ("max_held",),
}


def told_level(said: int) -> int:
    """The level a peer's batch tells: what it said, 1 for an older
    release's batch (which has no such field: 0)."""
    return max(1, said)


def refusal(
    kind: str | None,
    me: int,
    voters: Iterable[int],
    learners: Iterable[int],
    levels: Mapping[int, int],
) -> RoadlogError | None:
    """Why ``kind`` may not be proposed now (None: it may), by node ``me``
    leading a group of ``voters`` and ``learners``; ``levels``: what each peer's latest
    batch said (``RaftBatch.op_level``, 0 from an older release: read with
    ``told_level``), absent if not heard from."""
    if kind is None:
        return None  # no operation at all: the apply answers it
    need = LEVELS.get(kind, OP_LEVEL + 1)  # not listed: newer than anyone runs
    if need <= 1:
        return None
    older, unknown = [], []
    for n in sorted({*voters, *learners}):
        if n == me:
            continue
        level = levels.get(n)
        if level is None:
            unknown.append(n)
        elif told_level(level) < need:
            older.append(n)
    if older:
        who = ", ".join(f"n{n}" for n in older)
        verb = "runs" if len(older) == 1 else "run"
        return RoadlogError(
            Code.FAILED_PRECONDITION,
            f"cluster mid-upgrade: {who} {verb} an older release (that would skip a {kind} "
            "operation); upgrade every node, then retry",
        )
    if unknown:
        who = ", ".join(f"n{n}" for n in unknown)
        return RoadlogError(
            Code.FAILED_PRECONDITION,
            f"cluster mid-upgrade? the release of {who} is not known (not heard from since "
            f"this leader started), and an older one would skip a {kind} operation; retry "
            "once every node is up",
        )
    return None


def everyone_at(
    level: int,
    me: int,
    voters: Iterable[int],
    learners: Iterable[int],
    levels: Mapping[int, int],
) -> bool:
    """Whether every member but ``me`` is known to apply ``level`` (what
    its latest batch said); a member not heard from is not."""
    for n in {*voters, *learners}:
        said = levels.get(n)
        if n != me and (said is None or told_level(said) < level):
            return False
    return True


def admit(
    op: command_pb2.Op,
    kind: str | None,
    me: int,
    voters: Iterable[int],
    learners: Iterable[int],
    levels: Mapping[int, int],
) -> None:
    """The leader's check of ``op`` (of ``kind``) before it proposes it:
    ``refusal``'s error raised, if any; ``NEWER_FIELDS`` cleared while a
    member might ignore them. A kind of level 1 without such fields (an
    append) costs two lookups and nothing else."""
    if LEVELS.get(kind or "") != 1:
        err = refusal(kind, me, voters, learners, levels)
        if err is not None:
            raise err
    fields = NEWER_FIELDS.get(kind or "")
    if fields and not everyone_at(FIELDS_LEVEL, me, voters, learners, levels):
        inner = getattr(op, str(kind))
        for name in fields:
            inner.ClearField(name)
