"""The runtime layer every daemon shares: config files and their checks,
logging, health and metrics endpoints, the event loop, systemd readiness,
and cluster authentication (one gRPC interceptor for every server).

It sits beside the shared model and below the daemons (node, queue server,
discovery, Spark source) and the tools; it imports none of them.
"""
