"""Unit tests of one Raft group on a node (node_daemon.replica)."""
