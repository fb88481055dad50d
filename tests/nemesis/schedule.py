"""A seeded, replayable fault schedule.

Each kind of fault has its own lane, drawn from its own ``random.Random``
seeded by (seed, kind): the same seed and length give the same schedule,
and adding a kind never changes the others'. Lanes overlap in time (a
partition may meet a pause and a clock jump), each lane's faults never
overlap each other. Targets are roles ("leader", "follower", ...) that
the injector resolves when the fault starts.

Invariants: every fault starts in [0, seconds) and lasts a positive,
bounded time; a lane's next fault starts after the previous one healed;
the count is bounded by seconds / (shortest duration + shortest gap).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KILL, PAUSE, PARTITION, LOSS, SLOW, DISK, CLOCK, WIPE, MEMBER, POWER, CORRUPT = (
    "kill",
    "pause",
    "partition",
    "loss",
    "slow",
    "disk",
    "clock",
    "wipe",
    "member",
    "power",
    "corrupt",
)
# One worker process of a node (data groups, issue 41): SIGKILLed (the node
# starts it again), or stopped with SIGSTOP and continued at heal.
WORKER_KILL, WORKER_PAUSE = "worker-kill", "worker-pause"
KINDS = (
    KILL, PAUSE, PARTITION, LOSS, SLOW, DISK, CLOCK, WIPE, MEMBER, POWER, CORRUPT,
    WORKER_KILL, WORKER_PAUSE,
)  # fmt: skip


@dataclass(frozen=True)
class Lane:
    """How a kind's faults are drawn: duration and gap ranges in seconds,
    and targets with weights."""

    duration: tuple[float, float]
    gap: tuple[float, float]
    targets: tuple[tuple[str, int], ...]


# The election timeout is 0.5-1 s (25-50 ticks of 20 ms): pauses last longer.
# A lane's mean cycle (duration + gap) is 5-8 s: 30 minutes give about 300
# faults of each kind or more.
# "leader" is group 0's leader; "group-leader" the node leading a data group
# drawn at the fault's start (with leaders spread, another node, most often;
# in a cluster of one group, group 0's leader), and for the worker kinds the
# worker process that runs that group there.
LANES: dict[str, Lane] = {
    KILL: Lane(
        (0.5, 5.0),
        (1.0, 5.0),
        (
            ("leader", 3),
            ("group-leader", 2),
            ("follower", 3),
            ("minority", 1),
            ("all", 1),
            ("queue", 2),
            ("queues", 1),
        ),
    ),
    PAUSE: Lane(
        (1.2, 4.0),
        (1.0, 5.0),
        (("leader", 3), ("group-leader", 2), ("follower", 2), ("queue", 1)),
    ),
    PARTITION: Lane(
        (1.0, 4.0),
        (1.0, 4.0),
        (
            ("leader-isolated", 3),
            ("group-leader-isolated", 2),
            ("majority-minority", 2),
            ("bridge", 1),
            ("one-way", 2),
        ),
    ),
    LOSS: Lane((1.0, 4.0), (1.0, 4.0), (("node", 2), ("all", 1))),
    # This kernel has no netem (no fixed delay): a slow link instead, a token
    # bucket on the host's way out whose queue holds up to seconds of data.
    SLOW: Lane(
        (1.0, 4.0),
        (1.0, 4.0),
        (("leader", 2), ("group-leader", 1), ("follower", 1), ("queue", 1)),
    ),
    DISK: Lane((1.5, 5.0), (1.0, 4.0), (("leader", 2), ("follower", 2))),
    CLOCK: Lane((2.0, 6.0), (0.5, 3.0), (("leader", 2), ("follower", 2))),
    # The kinds that take a copy or a member wait for a quiet cluster (every
    # node a voter holding its copy, a leader known) and start only about
    # half the time: shorter cycles, so that a long run still gets 300.
    WIPE: Lane((0.2, 1.0), (0.2, 1.5), (("follower", 1),)),
    # A voter removed from the configuration (it keeps running) and added
    # back as a learner, which the leader promotes once it has caught up.
    MEMBER: Lane((0.3, 1.5), (0.2, 1.5), (("follower", 3), ("leader", 1))),
    # Machines losing power (what they had not fsynced is gone; Jepsen's
    # coordinated power failures are "all"), back on after the duration.
    POWER: Lane(
        (0.5, 5.0),
        (1.0, 5.0),
        (("leader", 3), ("group-leader", 2), ("follower", 3), ("minority", 1), ("all", 1)),
    ),
    # A follower's disk damages its Raft log while it is down (a minority's
    # copy, as a wipe: only when the others hold theirs): a byte of an entry
    # flipped, or the file cut short.
    CORRUPT: Lane((0.2, 1.0), (0.2, 1.5), (("follower", 1),)),
    # A worker process: the one running a data group on that group's leader
    # (its groups elect again elsewhere), or any node's. A killed one stays
    # dead for its duration at most: the node starts it again after its
    # backoff; a stopped one is continued at heal.
    # Shorter cycles than a node's: a worker fault finds no target more
    # often (no data group's leader known in a storm, a worker being started
    # again), and a long run must still give 300 of each.
    WORKER_KILL: Lane((0.3, 2.0), (0.5, 3.0), (("group-leader", 3), ("any", 2))),
    WORKER_PAUSE: Lane((1.2, 3.0), (0.5, 3.0), (("group-leader", 3), ("any", 2))),
}


@dataclass(frozen=True)
class Fault:
    """One fault: start ``at`` seconds into the run, heal ``duration`` later."""

    id: str
    at: float
    kind: str
    target: str
    duration: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.at + self.duration


def _params(kind: str, target: str, rng: random.Random) -> dict[str, Any]:
    if kind == LOSS:
        return {"percent": rng.choice((5, 10, 20, 30, 40))}
    if kind == SLOW:
        return {"kbit": rng.choice((64, 256, 1024)), "queue_ms": rng.choice((500, 1500, 3000))}
    if kind == DISK:
        return {"fill": rng.choice(("full", "low"))}  # ENOSPC, or under min_free_bytes
    if kind == CLOCK:
        # Forward or back by half a minute to three hours, back to true at heal:
        # inside the 24 h future slack of validation and the 7-day retention.
        sign = rng.choice((1, -1))
        return {"offset_s": sign * rng.choice((30, 300, 1800, 3600, 10_800))}
    if kind == CORRUPT:
        # The group whose log is damaged: a draw resolved at the start over
        # the groups the node holds (0 is group 0; in a cluster of one group
        # every draw is group 0).
        return {
            "how": rng.choice(("entry", "entry", "truncate")),
            "at": rng.random(),
            "group_draw": rng.random(),
        }
    if kind == PARTITION and target == "one-way":
        return {"from_leader": rng.random() < 0.5}  # who stops hearing whom
    return {}


# The kinds that take a node, a link, the leadership or the room to write
# away (a follower whose disk is full holds back a catching-up node's
# release: a long run's calms stalled on them). Wipes,
# corruptions and membership changes (QUIET_KINDS) start only while none of
# that is under way (every node a voter holding its copy, a leader known):
# a long run that must give 300 of those too spaces these out (``pace``),
# or alternates storms and calms (``phases``).
DISRUPTIVE = (KILL, PAUSE, PARTITION, LOSS, SLOW, POWER, DISK, WORKER_KILL, WORKER_PAUSE)
QUIET_KINDS = (WIPE, CORRUPT, MEMBER)


def _in_phase(t: float, kind: str, phases: tuple[float, float] | None) -> float:
    """``t``, or the start of the next phase where ``kind`` may start: with
    ``phases`` = (storm, calm) seconds, repeated, the DISRUPTIVE kinds start
    only in storms, the QUIET_KINDS only in calms, the rest at any time."""
    if phases is None:
        return t
    storm, calm = phases
    cycle = storm + calm
    k, into = divmod(t, cycle)
    if kind in DISRUPTIVE and into >= storm:
        return (k + 1) * cycle
    if kind in QUIET_KINDS and into < storm:
        return k * cycle + storm
    return t


def generate(
    seed: int,
    seconds: float,
    kinds: tuple[str, ...] = KINDS,
    pace: float = 1.0,
    phases: tuple[float, float] | None = None,
) -> list[Fault]:
    """The schedule for ``seconds`` of faults, sorted by start time; the
    gaps of the DISRUPTIVE lanes are ``pace`` times their usual length,
    and with ``phases`` each kind starts only in its phases (_in_phase)."""
    out: list[Fault] = []
    for kind in kinds:
        lane = LANES[kind]
        stretch = pace if kind in DISRUPTIVE else 1.0
        rng = random.Random(f"{seed}:{kind}")
        names = [t for t, _ in lane.targets]
        weights = [w for _, w in lane.targets]
        # The first fault of every lane starts in the first 10 s (the first
        # third of a short run: it sees every kind), the rest follow its gaps.
        t = _in_phase(rng.uniform(0.5, max(1.0, min(seconds / 3, 10.0))), kind, phases)
        k = 0
        while t < seconds - 0.5:
            target = rng.choices(names, weights)[0]
            dur = min(rng.uniform(*lane.duration), max(0.5, seconds - t))
            out.append(
                Fault(f"{kind}-{k}", round(t, 3), kind, target, round(dur, 3),
                      _params(kind, target, rng))
            )  # fmt: skip
            k += 1
            t = _in_phase(t + dur + stretch * rng.uniform(*lane.gap), kind, phases)
    out.sort(key=lambda f: (f.at, f.id))
    return out


def save(faults: list[Fault], path: Path, seed: int, seconds: float) -> None:
    doc = {"seed": seed, "seconds": seconds, "faults": [asdict(f) for f in faults]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def load(path: Path) -> tuple[int, float, list[Fault]]:
    """(seed, seconds, faults) of a saved schedule, to replay it."""
    doc = json.loads(path.read_text())
    return doc["seed"], doc["seconds"], [Fault(**f) for f in doc["faults"]]
