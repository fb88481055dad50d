"""The replicated state machine, on LMDB: topics and their pings (dense
offsets per partition, idempotent producers, retention, time indexes),
consumer groups, heat maps and contributions, the address book, and
snapshots of it all. Every replica applies the same committed entries to
the same bytes (``machine.StateMachine``); ``groups`` and ``heatmaps`` hold
the tables of their own concern."""

from node_daemon.state.machine import OpResult, StateMachine, append_op, normalized_spec

__all__ = ["OpResult", "StateMachine", "append_op", "normalized_spec"]
