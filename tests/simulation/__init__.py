"""Deterministic simulation of Raft clusters (see harness.py)."""
