"""One Raft group on this node: its ``Replica`` (the core driven by asyncio
with its log and state machine), its snapshots, the log's clock, its status,
and a group another process of the node runs, as read from here
(``remote``)."""
