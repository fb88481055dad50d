"""Unit tests of the Raft log and the node's files (node_daemon.storage)."""
