"""Unit tests of the sans-I/O Raft core (node_daemon.raft)."""
