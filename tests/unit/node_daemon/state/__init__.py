"""Unit tests of the replicated state machine (node_daemon.state)."""
