"""Unit tests of a node's groups in one process (node_daemon.store)."""
