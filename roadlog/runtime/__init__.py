"""The runtime layer every daemon shares: config files and their checks,
logging, health and metrics endpoints, the event loop, systemd readiness,
cluster authentication (one gRPC interceptor for every server), and local
processes and loopback ports (processes: shared with the tools and Spark's
standalone launcher).

It sits beside the shared model and below the daemons (node, queue server,
discovery, Spark source) and the tools; it imports none of them.
"""
