"""The node's processes and their wiring: ``roadlog-node`` (``main``), a
node process wired (``serve``), its gRPC server and Admin service, the
worker pool and a worker process with the pipe between them, metrics,
backups and the node's id."""
