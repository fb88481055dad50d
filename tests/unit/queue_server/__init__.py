"""Unit tests of the queue server (queue_server)."""
