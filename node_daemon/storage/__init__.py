"""The node's files on disk: the Raft log on LMDB (``raft_log``), the log
entries a state snapshot carries (``kept_log``), damage checks before a log
is trusted, free space, the boot id, and the thread that runs the blocking
writes."""
