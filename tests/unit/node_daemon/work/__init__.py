"""Unit tests of the work protocol with the queue servers (node_daemon.work)."""
