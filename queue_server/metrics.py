"""The queue server's Prometheus metrics, declared once (the queues, the
nodes' sessions, the client front)."""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from roadlog.rpc import Kind
from roadlog.runtime.build_info import BUILD_INFO as BUILD_INFO  # exported with the rest

DEPTH = Gauge("roadlog_queue_depth", "requests waiting", ["kind"])
DEPTH_BYTES = Gauge("roadlog_queue_bytes", "bytes of requests waiting", ["kind"])
WAIT = Histogram(
    "roadlog_queue_wait_seconds",
    "time from arrival to being handed to a node",
    ["kind"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
TAKEN = Counter("roadlog_queue_work_taken_total", "work handed to each node", ["node", "kind"])
REQUESTS = Counter(
    "roadlog_queue_requests_total", "client requests by method and outcome", ["method", "code"]
)
WORKERS = Gauge("roadlog_queue_connected_nodes", "nodes pulling work from this queue server")
SPLIT = Counter(
    "roadlog_queue_split_publishes_total",
    "calls with publishes group 0's leader split over data groups (their senders did not "
    "route them by group), and the parts handed out",
    ["what"],
)
_SPLIT_CALLS, _SPLIT_PARTS = SPLIT.labels("calls"), SPLIT.labels("parts")
FRAMES_REJECTED = Counter(
    "roadlog_queue_frames_rejected_total",
    "framed Work links refused (bad hello) or cut (bad input)",
)
PUBLISH_LINKS_REJECTED = Counter(
    "roadlog_queue_publish_links_rejected_total",
    "clients' publish links cut for bad input (a bad hello or envelope, a frame too big)",
)
ANSWERED = Histogram(
    "roadlog_queue_answer_seconds",
    "time from a client request's arrival (gRPC or HTTP) to its answer, by method and outcome "
    "(ok, error); for publishes: the ack latency",
    ["method", "outcome"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 30),
)


def count_publish_batch(code: str) -> None:
    """A PublishBatch over a stream or a publish link was answered with ``code``."""
    REQUESTS.labels("PublishBatch", code).inc()


# Metric children bound once (labels() per item or per kick costs more than
# the count itself).
_KIND_LABEL = {Kind.WRITE: "write", Kind.READ: "read"}
_DEPTH = {k: DEPTH.labels(label) for k, label in _KIND_LABEL.items()}
_DEPTH_BYTES = {k: DEPTH_BYTES.labels(label) for k, label in _KIND_LABEL.items()}
_WAIT = {k: WAIT.labels(label) for k, label in _KIND_LABEL.items()}


@functools.cache
def _taken(node_id: int, kind: Kind) -> Any:
    return TAKEN.labels(str(node_id), _KIND_LABEL[kind])
