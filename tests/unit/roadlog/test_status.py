"""One spelling of the Raft roles and one JSON view of a node's status."""

from __future__ import annotations

import pytest

from node_daemon.raft import Role
from roadlog.status import ROLES, node_json, role_name
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit


def test_every_role_of_the_core_has_its_one_spelling() -> None:
    assert [role_name(r.name) for r in Role] == list(ROLES)
    assert role_name("PRE_CANDIDATE") == "pre-candidate"
    with pytest.raises(ValueError, match="not a Raft role"):
        role_name("LEARNER")


def test_the_json_view_carries_every_field_tools_read() -> None:
    ns = client_pb2.NodeStatus(
        id=2, address="h:1", role="leader", term=4, commit_index=9, applied_index=8, leader=2
    )
    ns.ready = True
    ns.version = "0.1.0+gabc"
    group0 = dict(id=0, role="leader", term=4, commit_index=9, applied_index=8, leader=2)
    ns.groups.add(**group0, voters=[1, 2], conf_index=7)
    group1 = dict(id=1, role="follower", term=2, commit_index=5, applied_index=5, leader=3)
    ns.groups.add(**group1, learners=[4], catching_up=True)
    assert node_json(ns) == {
        "id": 2,
        "address": "h:1",
        "role": "leader",
        "term": 4,
        "commit_index": 9,
        "applied_index": 8,
        "leader": 2,
        "ready": True,
        "version": "0.1.0+gabc",
        "groups": [
            {
                "id": 0,
                "role": "leader",
                "term": 4,
                "commit_index": 9,
                "applied_index": 8,
                "leader": 2,
                "voters": [1, 2],
                "learners": [],
                "conf_index": 7,
                "catching_up": False,
            },
            {
                "id": 1,
                "role": "follower",
                "term": 2,
                "commit_index": 5,
                "applied_index": 5,
                "leader": 3,
                "voters": [],
                "learners": [4],
                "conf_index": 0,
                "catching_up": True,
            },
        ],
    }
