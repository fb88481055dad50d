"""The node's groups in one process (``store.Store``): group 0, the
metadata group, and the data groups; how many data groups a node founds,
the cluster's membership (group 0's), the data groups following group 0's
membership and topics, their leaders spread over the nodes, and the lock
that keeps a data group in one process."""
