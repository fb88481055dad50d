"""roadlog: GPS pings replicated with Raft to LMDB, turned into traffic heat maps.

This package holds what clients and every component share (the GPS/topic
model, validation, the client SDK and the CLI); they arrive with the cluster.
"""

__version__ = "0.1.0"
