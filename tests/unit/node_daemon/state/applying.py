"""One state machine fed committed entries by hand, one op an entry, for
the state tests that drive ``StateMachine.apply`` directly."""

from __future__ import annotations

from pathlib import Path

from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine
from node_daemon.state.responses import OpResult
from roadlog.errors import Code
from roadlog.v1 import command_pb2

T0 = 1_800_000_000_000  # the leader's clock of the first entry (ms)


class Applying:
    """``apply`` an op as the next committed entry (index 1, 2, ...);
    ``ok`` also asserts it succeeded and returns its response."""

    def __init__(self, path: Path) -> None:
        self.sm = StateMachine(path, map_size=64 << 20)
        self.index = 0

    def apply(self, op: command_pb2.Op, at_ms: int = T0) -> OpResult:
        self.index += 1
        cmd = command_pb2.Command(leader_ms=at_ms, ops=[op]).SerializeToString()
        [[res]] = self.sm.apply([Entry(1, self.index, EntryType.NORMAL, cmd)])
        return res.spans[0] if res.spans else res

    def ok(self, op: command_pb2.Op, at_ms: int = T0) -> bytes:
        res = self.apply(op, at_ms)
        assert res.code == Code.OK, res.message
        return res.response
