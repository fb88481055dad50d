"""Unit tests of the peer links and their wire (node_daemon.transport)."""
