"""LMDB storage: the Raft log and hard state (separate from the state machine)."""
