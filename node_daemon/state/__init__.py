"""The replicated state machine, on LMDB: topics and their pings (dense
offsets per partition, idempotent producers, retention, time indexes),
consumer groups, heat maps and contributions, the address book, and
snapshots of it all. Every replica applies the same committed entries to
the same bytes (``machine.StateMachine``); ``topics``, ``producers``,
``consumer_groups``, ``clients`` and ``heatmaps`` hold the tables of their
own concern."""

from node_daemon.state.machine import StateMachine, append_op
from node_daemon.state.responses import OpResult
from node_daemon.state.topics import normalized_spec

__all__ = ["OpResult", "StateMachine", "append_op", "normalized_spec"]
