"""Unit tests of a node process wired: roadlog-node, admin, backup, worker
processes (node_daemon.process)."""
