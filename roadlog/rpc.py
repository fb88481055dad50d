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
``tests/unit/roadlog/test_rpc.py`` checks the table against the proto's service
descriptor, so an rpc added to the proto cannot be forgotten here.

``needs`` says what a caller's identity must hold (issue 19; the queue
server checks it, ``queue_server/auth.py``): ``public`` (no token),
``identity`` (any valid token), ``admin``, or a scope kind (``produce``,
``read``, ``heatmap``) for the topic the request names (an rpc whose request
names no topic: a scope of that kind for some topic). Every row must say; a
test checks every rpc and every HTTP route has a rule.

``group_topic``: the request names a consumer group (or, ListGroups, all of
them), whose topic only the node knows (issue 39, finding 5). The queue
server checks ``needs`` for some topic, as above (a cheap refusal for an
identity with no such scope at all), and hands the caller's scopes to the
node with the work item (``WorkItem.scopes``); the node checks them against
the group's own topic where it reads the group
(``node_daemon/work/group_access.py``): a group of a topic the caller may
not read is answered as one that does not exist, and ListGroups leaves it
out. The check sits where the group is read, in the same moment, so no
group can be deleted and made again for another topic in between.

The wire facts of an rpc that its users read off a request's bytes without
parsing it are in its row too, taken from the generated ``*_FIELD_NUMBER``
constants (``tests/unit/roadlog/test_rpc.py`` checks them against the
descriptors): ``topic_field``, where the request names the topic its scope
is checked against (``queue_server/auth.py``), and ``group_hint_field``,
the varint a publish's data group is written in first
(``roadlog/protowire.py``: the SDK writes it, the queue server reads it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

from google.protobuf.message import Message

from roadlog.v1 import (
    client_pb2,
    clients_pb2,
    command_pb2,
    federation_pb2,
    groups_pb2,
    settings_pb2,
    topics_pb2,
)

SERVICE = "roadlog.v1.Roadlog"
FENCE_FIELD = "min_applied_index"
# What an rpc's caller needs (see the module's doc).
PUBLIC, IDENTITY, ADMIN = "public", "identity", "admin"
NEEDS = (PUBLIC, IDENTITY, ADMIN, "produce", "read", "heatmap")


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
    needs: str
    http: HttpRoute | None = None
    # The field numbers from the request down to the string that names its
    # topic, a repeated message field on the way meaning each of its
    # messages names one (PublishBatch: requests, then topic); (): none.
    topic_field: tuple[int, ...] = ()
    # The varint field of the request a publish's routing hint (the data
    # group all its pings lie in) is written in, first; 0: it has none.
    group_hint_field: int = 0
    # The request names a consumer group: its scope is for the group's
    # topic, checked by the node with the scopes the item carries (see the
    # module's doc).
    group_topic: bool = False

    @property
    def fenced(self) -> bool:
        """A read that carries a fence (``min_applied_index``)."""
        return FENCE_FIELD in self.request.DESCRIPTOR.fields_by_name

    @property
    def handler(self) -> str:
        """The name of the method that does it: ``PublishBatch`` -> ``publish_batch``."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", self.name).lower()


W, R = Kind.WRITE, Kind.READ
c, g, t, k, s = client_pb2, groups_pb2, topics_pb2, clients_pb2, settings_pb2
f = federation_pb2

RPCS: tuple[Rpc, ...] = (
    Rpc(
        "CreateTopic",
        W,
        c.CreateTopicRequest,
        t.TopicDescription,
        ADMIN,
        HttpRoute("POST", "/v1/topics"),
    ),
    Rpc(
        "DescribeTopic",
        R,
        c.DescribeTopicRequest,
        t.TopicDescription,
        IDENTITY,
        HttpRoute("GET", "/v1/topics/{name}"),
    ),
    Rpc(
        "ListTopics",
        R,
        c.ListTopicsRequest,
        c.ListTopicsResponse,
        IDENTITY,
        HttpRoute("GET", "/v1/topics"),
    ),
    Rpc("DeleteTopic", W, c.DeleteTopicRequest, c.DeleteTopicResponse, ADMIN),
    Rpc(
        "InitProducer",
        W,
        c.InitProducerRequest,
        c.InitProducerResponse,
        "produce",
        HttpRoute("POST", "/v1/producers"),
    ),
    Rpc(
        "Publish",
        W,
        c.PublishRequest,
        c.PublishResponse,
        "produce",
        HttpRoute("POST", "/v1/topics/{name}/pings"),
        topic_field=(c.PublishRequest.TOPIC_FIELD_NUMBER,),
        group_hint_field=c.PublishRequest.GROUP_FIELD_NUMBER,
    ),
    Rpc(
        "PublishBatch",
        W,
        c.PublishBatchRequest,
        c.PublishBatchResponse,
        "produce",
        topic_field=(
            c.PublishBatchRequest.REQUESTS_FIELD_NUMBER,
            c.PublishRequest.TOPIC_FIELD_NUMBER,
        ),
        group_hint_field=c.PublishBatchRequest.GROUP_FIELD_NUMBER,
    ),
    Rpc(
        "Fetch",
        R,
        c.FetchRequest,
        c.FetchResponse,
        "read",
        HttpRoute("GET", "/v1/topics/{name}/partitions/{partition}/pings"),
        topic_field=(c.FetchRequest.TOPIC_FIELD_NUMBER,),
    ),
    # Answered by the queue server from a ReadIndex of each group's leader.
    Rpc(
        "ReadFences",
        None,
        c.ReadFencesRequest,
        c.ReadFencesResponse,
        "read",
        HttpRoute("GET", "/v1/topics/{name}/fences"),
        topic_field=(c.ReadFencesRequest.TOPIC_FIELD_NUMBER,),
    ),
    # The cluster's layout (nodes, their roles and indexes): any identity
    # may see it, a stranger may not (issue 19, finding 15); the nodes'
    # addresses only an identity with admin or ops (issue 39).
    Rpc(
        "Status", None, c.StatusRequest, c.ClusterStatus, IDENTITY, HttpRoute("GET", "/v1/cluster")
    ),
    Rpc(
        "JoinGroup",
        W,
        c.JoinGroupRequest,
        c.JoinGroupResponse,
        "read",
        topic_field=(c.JoinGroupRequest.TOPIC_FIELD_NUMBER,),
    ),
    # read:TOPIC of the group's own topic, checked by the node (group_topic).
    Rpc("Heartbeat", W, c.HeartbeatRequest, c.HeartbeatResponse, "read", group_topic=True),
    Rpc(
        "CommitOffsets",
        W,
        c.CommitOffsetsRequest,
        c.CommitOffsetsResponse,
        "read",
        group_topic=True,
    ),
    Rpc("LeaveGroup", W, c.LeaveGroupRequest, c.LeaveGroupResponse, "read", group_topic=True),
    Rpc("DescribeGroup", R, c.DescribeGroupRequest, g.GroupDescription, "read", group_topic=True),
    Rpc("ListGroups", R, c.ListGroupsRequest, c.ListGroupsResponse, "read", group_topic=True),
    # Admin (every topic's reader): a deletion throws away every member's
    # committed offsets and frees its owner's quota, which no one reader of
    # the topic should decide for the others.
    Rpc("DeleteGroup", W, c.DeleteGroupRequest, c.DeleteGroupResponse, ADMIN),
    Rpc(
        "GetHeatmap",
        R,
        c.GetHeatmapRequest,
        c.GetHeatmapResponse,
        "heatmap",
        HttpRoute("GET", "/v1/topics/{name}/heatmap"),
        topic_field=(c.GetHeatmapRequest.TOPIC_FIELD_NUMBER,),
    ),
    Rpc("PutHeatmap", W, c.PutHeatmapRequest, c.PutHeatmapResponse, ADMIN),
    Rpc("CreateClient", W, k.CreateClientRequest, k.CreateClientResponse, ADMIN),
    Rpc("ListClients", R, k.ListClientsRequest, k.ListClientsResponse, ADMIN),
    Rpc("RevokeClient", W, k.RevokeClientRequest, k.RevokeClientResponse, ADMIN),
    # Open self-registration: the queue server's setting and rate limit decide.
    Rpc(
        "RegisterClient",
        W,
        k.RegisterClientRequest,
        k.CreateClientResponse,
        PUBLIC,
        HttpRoute("POST", "/v1/clients"),
    ),
    # What a self-registered phone may do, and the cluster's other
    # settings: the operator's choice (issue 39, item 3).
    Rpc("UpdateTopic", W, c.UpdateTopicRequest, t.TopicDescription, ADMIN),
    # Group 0's leader answers (a get after a set sees it, from any caller).
    Rpc("GetSettings", W, s.GetSettingsRequest, s.GetSettingsResponse, ADMIN),
    Rpc("SetSetting", W, s.SetSettingRequest, s.SetSettingResponse, ADMIN),
    # Federation (issue 43), on a directory: members register and report
    # with the directory's admin token in this first slice (docs/federation.md);
    # any identity may look a topic's home up.
    Rpc("RegisterMember", W, f.RegisterMemberRequest, f.RegisterMemberResponse, ADMIN),
    Rpc("ReportLoad", W, f.ReportLoadRequest, f.ReportLoadResponse, ADMIN),
    Rpc(
        "PlaceTopic",
        W,
        f.PlaceTopicRequest,
        f.TopicHome,
        ADMIN,
        topic_field=(f.PlaceTopicRequest.TOPIC_FIELD_NUMBER,),
    ),
    Rpc(
        "ForgetTopicHome",
        W,
        f.ForgetTopicHomeRequest,
        f.ForgetTopicHomeResponse,
        ADMIN,
        topic_field=(f.ForgetTopicHomeRequest.TOPIC_FIELD_NUMBER,),
    ),
    Rpc(
        "LookupTopic",
        R,
        f.LookupTopicRequest,
        f.TopicHome,
        IDENTITY,
        topic_field=(f.LookupTopicRequest.TOPIC_FIELD_NUMBER,),
    ),
    Rpc("GetFederation", R, f.GetFederationRequest, f.Federation, IDENTITY),
    # Topic moves (issue 43): on a member, the source's fence and state, the
    # target's import; on the directory, the home's flip. The pings
    # themselves are read with Fetch. A mover's calls never follow a
    # redirect (roadlog.federation.move).
    Rpc(
        "FenceTopic",
        W,
        f.FenceTopicRequest,
        f.FenceTopicResponse,
        ADMIN,
        topic_field=(f.FenceTopicRequest.TOPIC_FIELD_NUMBER,),
    ),
    Rpc(
        "ExportTopicState",
        R,
        f.ExportTopicStateRequest,
        f.ExportTopicStateResponse,
        ADMIN,
        topic_field=(f.ExportTopicStateRequest.TOPIC_FIELD_NUMBER,),
    ),
    Rpc(
        "ImportTopic",
        W,
        f.ImportTopicRequest,
        f.ImportTopicResponse,
        ADMIN,
        topic_field=(f.ImportTopicRequest.TOPIC_FIELD_NUMBER,),
    ),
    Rpc(
        "MoveTopicHome",
        W,
        f.MoveTopicHomeRequest,
        f.TopicHome,
        ADMIN,
        topic_field=(f.MoveTopicHomeRequest.TOPIC_FIELD_NUMBER,),
    ),
)
# The queue server's own reads, never offered to clients: a node does them
# as it does the rpcs above (``WorkHandler.<handler>``).
# Authenticate: any node that applied the fence; AuthenticateAtLeader: the
# leader (which has applied every identity whose creation was answered),
# asked when a node found no identity for a token.
INTERNAL: dict[str, Rpc] = {
    "Authenticate": Rpc(
        "Authenticate", R, k.AuthenticateRequest, k.AuthenticateResponse, "internal"
    ),
    "AuthenticateAtLeader": Rpc(
        "AuthenticateAtLeader", W, k.AuthenticateRequest, k.AuthenticateResponse, "internal"
    ),
    # Self-registered identities a queue server saw used, for group 0's
    # leader's next trim (node_daemon/state/clients.py).
    "ClientsUsed": Rpc("ClientsUsed", W, k.ClientsUsedRequest, k.ClientsUsedResponse, "internal"),
    # A part of publishes split across data groups (multi-raft): an AppendOp
    # group 0's leader validated, for its group's leader; a result per span.
    "AppendPart": Rpc("AppendPart", W, command_pb2.AppendOp, c.PublishBatchResponse, "internal"),
    # One group's commit index at its leader, for a ReadFences.
    "ReadIndex": Rpc("ReadIndex", W, c.ReadIndexRequest, c.ReadIndexResponse, "internal"),
}
del W, R, c, g, t, k, s, f

BY_NAME: dict[str, Rpc] = {r.name: r for r in RPCS}
# The rpcs that go through the work queues to a node (all but Status and
# ReadFences, which the queue server answers).
QUEUED: dict[str, Rpc] = {r.name: r for r in RPCS if r.kind is not None}
# What a node may be handed: the queued rpcs and the queue server's own reads.
ROUTED: dict[str, Rpc] = {**QUEUED, **INTERNAL}
