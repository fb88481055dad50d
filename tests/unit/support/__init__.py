"""Helpers shared by unit tests of several folders (event loops, Raft cores driven by hand)."""
