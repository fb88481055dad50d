"""A node's status as every tool and endpoint shows it: one spelling of the
Raft roles, one JSON view of a ``NodeStatus``, and one way to ask a node."""

from __future__ import annotations

from typing import Any

import grpc

from roadlog.client_tls import ClientTLS
from roadlog.v1 import admin_pb2_grpc, client_pb2

ROLES = ("follower", "pre-candidate", "candidate", "leader")
DOWN = "down"  # what tools show for a node that did not answer


def role_name(enum_name: str) -> str:
    """The one spelling of a role ("PRE_CANDIDATE" -> "pre-candidate")."""
    name = enum_name.lower().replace("_", "-")
    if name not in ROLES:
        raise ValueError(f"not a Raft role: {enum_name!r}")
    return name


def node_json(ns: client_pb2.NodeStatus) -> dict[str, Any]:
    """The JSON view of one node's status (CLI, HTTP /v1/cluster, tools)."""
    return {
        "id": ns.id,
        "address": ns.address,
        "role": ns.role,
        "term": ns.term,
        "commit_index": ns.commit_index,
        "applied_index": ns.applied_index,
        "leader": ns.leader,
        "ready": ns.ready,
        "version": ns.version,  # its release ("": one from before releases were told)
        # each Raft group the node runs, as it sees it (group 0 first)
        "groups": [
            {
                "id": g.id,
                "role": g.role,
                "term": g.term,
                "commit_index": g.commit_index,
                "applied_index": g.applied_index,
                "leader": g.leader,
                "voters": list(g.voters),
                "learners": list(g.learners),
                "conf_index": g.conf_index,  # committed once commit_index reaches it
                "catching_up": g.catching_up,  # lost its copy: votes again once caught up
            }
            for g in ns.groups
        ],
    }


def ask_node(address: str, timeout: float, tls: ClientTLS | None = None) -> dict[str, Any] | None:
    """A node's own status (``node_json``), and under "members" the
    addresses of the other members it knows; None if it does not answer.
    A node's port is mutual TLS: ``tls`` (default ``ClientTLS.from_env()``)
    needs a client certificate of the cluster's CA."""
    try:
        with (tls or ClientTLS.from_env()).channel(address) as ch:
            st = admin_pb2_grpc.AdminStub(ch).Status(client_pb2.StatusRequest(), timeout=timeout)
    except grpc.RpcError:
        return None
    return {
        "members": {o.id: o.address for o in st.nodes[1:] if o.address},
        **node_json(st.nodes[0]),
    }


def raft_group_views(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each Raft group as the nodes' statuses (``node_json`` views; a node
    that did not answer has role ``down``) tell it, by group id: its
    ``leader`` (the node the highest term's leader view names; 0: none),
    ``term`` (the highest seen), ``commit_index`` (the leader's, else the
    highest seen) and ``replicas``: each node that told the group, with its
    role, applied index and ``lag``, the leader's commit minus that
    replica's applied (0 at least). Nodes that tell no groups (older ones)
    run group 0 alone, with their own figures. ``cluster status`` and the
    dashboard's cluster panel both show this."""
    views: dict[int, list[dict[str, Any]]] = {0: []}
    for n in nodes:
        if n.get("groups"):
            for g in n["groups"]:
                views.setdefault(int(g["id"]), []).append({**g, "node": n["id"]})
        elif n.get("role", DOWN) != DOWN:
            views[0].append({**n, "node": n["id"]})
    out = []
    for g, seen in sorted(views.items()):
        leads = [v for v in seen if v["role"] == "leader"]
        lead = max(leads, key=lambda v: v["term"]) if leads else None
        commit = lead["commit_index"] if lead else max((v["commit_index"] for v in seen), default=0)
        out.append(
            {
                "id": g,
                "leader": lead["node"] if lead else 0,
                "term": max((v["term"] for v in seen), default=0),
                "commit_index": commit,
                "replicas": [
                    {
                        "node": v["node"],
                        "role": v["role"],
                        "applied_index": v.get("applied_index", 0),
                        "lag": max(0, commit - v.get("applied_index", 0)),
                    }
                    for v in sorted(seen, key=lambda v: v["node"])
                ],
            }
        )
    return out
