"""The work protocol with the queue servers: the handler that does a work
item (``handler``), the link that pulls them (``queue_link``), routing by
data group (``routing``), publishes merged into appends, the consumer-group
coordinator, and bulk reads for Spark (``node_read``)."""
