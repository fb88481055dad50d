"""Unit tests of discovery (discovery)."""
