"""The caller's scopes travel to the node with the rpcs that name a
consumer group (``Rpc.group_topic``; issue 39, finding 5): only the node
knows a group's topic, so it checks ``read:`` for it with them. Every other
rpc's work item carries none (nothing more on a publish's way), and an
item without an identity (client_auth none) none either."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from queue_server.auth import UNCHECKED, Principal
from queue_server.config import QueueConfig
from queue_server.outgoing import Outgoing
from queue_server.queues import Item, QueueFull
from queue_server.server import QueueServer
from roadlog.errors import RoadlogError
from roadlog.rpc import BY_NAME, RPCS
from roadlog.v1 import work_pb2

pytestmark = pytest.mark.unit

EVE = Principal("cl-eve", "eve", frozenset({"read:berlin", "produce:berlin"}))
GROUP_RPCS = {"Heartbeat", "CommitOffsets", "LeaveGroup", "DescribeGroup", "ListGroups"}


def test_the_rpcs_that_name_a_group_are_marked_in_the_table() -> None:
    """Every rpc whose request names a group but no topic, and ListGroups,
    has its group's topic checked by the node; JoinGroup names its topic
    (checked by the queue server), DeleteGroup needs admin."""
    assert {r.name for r in RPCS if r.group_topic} == GROUP_RPCS
    for r in RPCS:
        fields = r.request.DESCRIPTOR.fields_by_name
        if "group" in fields and fields["group"].type == fields["group"].TYPE_STRING:
            assert r.group_topic or r.topic_field or r.needs == "admin", r.name
    assert all(BY_NAME[n].needs == "read" for n in GROUP_RPCS)


def items_of(tmp_path: Path, method: str, principal: Principal | None) -> Item:
    """The work item ``QueueServer._call`` queues for ``method`` (caught at
    the queue: it is refused as full, so nothing waits for a node)."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    qs = QueueServer(QueueConfig(secret_file=secret))
    queued: list[Item] = []

    def submit(item: Item) -> None:
        queued.append(item)
        raise QueueFull("caught here")

    qs.q.submit = submit  # type: ignore[method-assign]
    request = BY_NAME[method].request().SerializeToString()
    with pytest.raises(RoadlogError):
        asyncio.run(qs._call(method, request, 5.0, "lane", principal))
    [item] = queued
    return item


@pytest.mark.parametrize("method", sorted(GROUP_RPCS))
def test_a_group_rpcs_item_carries_the_callers_scopes_to_the_node(
    tmp_path: Path, method: str
) -> None:
    item = items_of(tmp_path, method, EVE)
    assert item.principal == "cl-eve" and set(item.scopes) == EVE.scopes
    sent = work_pb2.WorkItems.FromString(b"".join(Outgoing.of(item, 0.0).parts())).items[0]
    assert sent.principal == "cl-eve" and set(sent.scopes) == EVE.scopes


@pytest.mark.parametrize("method", ["Publish", "Fetch", "InitProducer", "JoinGroup"])
def test_other_rpcs_items_carry_no_scopes(tmp_path: Path, method: str) -> None:
    item = items_of(tmp_path, method, EVE)
    assert item.principal == "cl-eve" and item.scopes == ()


def test_without_an_identity_nothing_is_sent(tmp_path: Path) -> None:
    """client_auth none: no principal, so the node checks nothing (as
    before identities); the queue server's own calls alike."""
    item = items_of(tmp_path, "DescribeGroup", UNCHECKED)
    assert item.principal == ""
    assert items_of(tmp_path, "ListGroups", None).scopes == ()
