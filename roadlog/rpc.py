"""The client RPC surface, declared once.

One row per rpc of the ``roadlog.v1.Roadlog`` service (the proto): its name,
how the queue server routes it (``kind``: a WRITE goes to the Raft leader, a
READ to any node that applied its fence; ``None``: the queue server answers
it itself), its request and response messages, and the HTTP route that
carries it, if any. A read is fenced (read your writes) when its request has
``min_applied_index``.

Derived from it: the queue server's routing and gRPC handlers, the node's
work dispatch (``WorkHandler.<rpc.handler>``), the HTTP routes
(``HttpApi.<rpc.handler>``) and the paths of the OpenAPI document.
``tests/unit/test_rpc.py`` checks the table against the proto's service
descriptor, so an rpc added to the proto cannot be forgotten here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

from google.protobuf.message import Message

from roadlog.v1 import client_pb2, groups_pb2, topics_pb2

SERVICE = "roadlog.v1.Roadlog"
FENCE_FIELD = "min_applied_index"


class Kind(IntEnum):
    """Which queue a request waits in."""

    WRITE = 1  # taken by the Raft leader
    READ = 2  # taken by any node that applied the request's fence


@dataclass(frozen=True, slots=True)
class HttpRoute:
    method: str  # "GET" or "POST"
    path: str


@dataclass(frozen=True, slots=True)
class Rpc:
    name: str
    kind: Kind | None  # None: answered by the queue server itself
    request: type[Message]
    response: type[Message]
    http: HttpRoute | None = None

    @property
    def fenced(self) -> bool:
        """A read that carries a fence (``min_applied_index``)."""
        return FENCE_FIELD in self.request.DESCRIPTOR.fields_by_name

    @property
    def handler(self) -> str:
        """The name of the method that does it: ``PublishBatch`` -> ``publish_batch``."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", self.name).lower()


W, R = Kind.WRITE, Kind.READ
c, g, t = client_pb2, groups_pb2, topics_pb2

RPCS: tuple[Rpc, ...] = (
    Rpc(
        "CreateTopic", W, c.CreateTopicRequest, t.TopicDescription, HttpRoute("POST", "/v1/topics")
    ),
    Rpc(
        "DescribeTopic",
        R,
        c.DescribeTopicRequest,
        t.TopicDescription,
        HttpRoute("GET", "/v1/topics/{name}"),
    ),
    Rpc("ListTopics", R, c.ListTopicsRequest, c.ListTopicsResponse, HttpRoute("GET", "/v1/topics")),
    Rpc("DeleteTopic", W, c.DeleteTopicRequest, c.DeleteTopicResponse),
    Rpc(
        "InitProducer",
        W,
        c.InitProducerRequest,
        c.InitProducerResponse,
        HttpRoute("POST", "/v1/producers"),
    ),
    Rpc(
        "Publish",
        W,
        c.PublishRequest,
        c.PublishResponse,
        HttpRoute("POST", "/v1/topics/{name}/pings"),
    ),
    Rpc("PublishBatch", W, c.PublishBatchRequest, c.PublishBatchResponse),
    Rpc(
        "Fetch",
        R,
        c.FetchRequest,
        c.FetchResponse,
        HttpRoute("GET", "/v1/topics/{name}/partitions/{partition}/pings"),
    ),
    Rpc("Status", None, c.StatusRequest, c.ClusterStatus, HttpRoute("GET", "/v1/cluster")),
    Rpc("JoinGroup", W, c.JoinGroupRequest, c.JoinGroupResponse),
    Rpc("Heartbeat", W, c.HeartbeatRequest, c.HeartbeatResponse),
    Rpc("CommitOffsets", W, c.CommitOffsetsRequest, c.CommitOffsetsResponse),
    Rpc("LeaveGroup", W, c.LeaveGroupRequest, c.LeaveGroupResponse),
    Rpc("DescribeGroup", R, c.DescribeGroupRequest, g.GroupDescription),
    Rpc("ListGroups", R, c.ListGroupsRequest, c.ListGroupsResponse),
    Rpc("DeleteGroup", W, c.DeleteGroupRequest, c.DeleteGroupResponse),
    Rpc(
        "GetHeatmap",
        R,
        c.GetHeatmapRequest,
        c.GetHeatmapResponse,
        HttpRoute("GET", "/v1/topics/{name}/heatmap"),
    ),
    Rpc("PutHeatmap", W, c.PutHeatmapRequest, c.PutHeatmapResponse),
)
del W, R, c, g, t

BY_NAME: dict[str, Rpc] = {r.name: r for r in RPCS}
# The rpcs that go through the work queues to a node (all but Status).
QUEUED: dict[str, Rpc] = {r.name: r for r in RPCS if r.kind is not None}
