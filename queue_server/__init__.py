"""The front door: client API, the leader-only write queue and the stealable read queue."""
