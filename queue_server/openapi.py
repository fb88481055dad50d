"""The OpenAPI 3.0 document of the HTTP/JSON API (served at /openapi.json;
the fuzz tests generate requests from it)."""

from __future__ import annotations

from typing import Any

from roadlog.limits import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, PAGE_BYTES
from roadlog.rpc import PUBLIC, RPCS

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "reason"],
            "properties": {"code": {"type": "string"}, "reason": {"type": "string"}},
        }
    },
}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """A required JSON request body of ``schema``."""
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in statuses:
        out[s] = {
            "description": {
                "400": "the request is malformed or invalid",
                "401": "no credential, or not a token the cluster issued "
                "(Authorization: Bearer TOKEN)",
                "403": "the token's identity lacks the scope (the reason names it), or "
                "give-to-get: it has not contributed lately",
                "404": "no such topic, partition or heat map",
                "409": "conflicts with what is stored",
                "413": "the body is too large",
                "503": "no leader or the queues are full: retry after Retry-After seconds",
                "504": "no answer before the deadline",
            }[s],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        if s == "400":
            # A request line or header field over 8190 bytes is refused by the
            # HTTP parser (aiohttp) before it reaches the API, in plain text.
            out[s]["description"] += (
                "; a request line or header field over 8190 bytes is refused before the "
                "API sees it, in plain text"
            )
            out[s]["content"]["text/plain"] = {"schema": {"type": "string"}}
    return out


def _ok(description: str, schema: dict[str, Any], status: str = "200") -> dict[str, Any]:
    return {
        status: {"description": description, "content": {"application/json": {"schema": schema}}}
    }


_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
_FENCE = {
    "name": "min_applied_index",
    "in": "query",
    "description": "read your writes: the applied_index a write answered",
    "schema": {"type": "integer", "minimum": 0},
}
_GROUP_FENCES = {
    "name": "group_fences",
    "in": "query",
    "description": "read your writes in a topic placed in data groups: GROUP:INDEX,... from a "
    "publish's group_fences",
    "schema": {"type": "string", "pattern": "^([0-9]+:[0-9]+)(,[0-9]+:[0-9]+)*$"},
}
_PAGE_SIZE = {
    "name": "page_size",
    "in": "query",
    "description": f"topics in one page (0 or absent: {DEFAULT_PAGE_SIZE}); a page also "
    f"closes at about {PAGE_BYTES >> 20} MiB",
    "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PAGE_SIZE},
}
_PAGE_TOKEN = {
    "name": "page_token",
    "in": "query",
    "description": "next_page_token of the page before (absent: the first page)",
    "schema": {"type": "string"},
}
_PING = {
    "type": "object",
    "required": ["device_id", "ts_ms", "lat", "lon"],
    "properties": {
        "device_id": {"type": "string", "minLength": 1, "maxLength": 64},
        "ts_ms": {"type": "integer", "minimum": 0},
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
        "speed_mps": {"type": "number", "nullable": True},
        "heading_deg": {"type": "number", "nullable": True},
        "accuracy_m": {"type": "number", "nullable": True},
    },
}
_SERVED_GROUP_FENCES = {
    "type": "object",
    "additionalProperties": {"type": "integer"},
    "description": "per data group, the index the read reflects (also the "
    "X-Roadlog-Group-Fences header, GROUP:INDEX,...): pass it back as group_fences",
}
_STORED_PING = {
    "type": "object",
    "properties": {
        "partition": {"type": "integer"},
        "offset": {"type": "integer"},
        **_PING["properties"],  # type: ignore[dict-item]
    },
}
_TOPIC = {
    "type": "object",
    "required": ["name", "region", "partitions", "partition_states"],
    "properties": {
        "name": {"type": "string"},
        "region": {"type": "object"},
        "partitions": {"type": "integer"},
        "retention_ms": {"type": "integer"},
        "h3_resolution": {"type": "integer"},
        "contribution_window_ms": {"type": "integer"},
        "contribution_min_pings": {"type": "integer"},
        "contribution_min_seconds": {"type": "integer"},
        "no_open_produce": {"type": "boolean"},
        "created_ms": {"type": "integer"},
        "bbox": {"type": "array", "items": {"type": "number"}},
        "partition_states": {"type": "array", "items": {"type": "object"}},
    },
}

# Each HTTP route of an rpc (roadlog.rpc), documented under the rpc's name;
# the path, the verb, the operationId and the fence parameter come from the table.
_OPERATIONS: dict[str, dict[str, Any]] = {
    "Status": {
        "summary": "The cluster as this queue server sees it",
        "responses": _ok(
            "leader, term, nodes and queue servers",
            {
                "type": "object",
                "properties": {
                    "leader": {"type": "integer"},
                    "term": {"type": "integer"},
                    "nodes": {"type": "array", "items": {"type": "object"}},
                    "queue_servers": {"type": "array", "items": {"type": "object"}},
                },
            },
        ),
    },
    "ListTopics": {
        "summary": "The topics in name order, a page at a time",
        "parameters": [_PAGE_SIZE, _PAGE_TOKEN],
        "responses": {
            **_ok(
                "a page of topics; next_page_token is there when more follow",
                {
                    "type": "object",
                    "properties": {
                        "topics": {"type": "array", "items": _TOPIC},
                        "next_page_token": {"type": "string"},
                    },
                },
            ),
            **_errors("400", "503", "504"),
        },
    },
    "CreateTopic": {
        "summary": "Create a topic (a city region)",
        "requestBody": _json_body(
            {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {
                        "type": "string",
                        "pattern": "^[a-z0-9][a-z0-9._-]{0,62}$",
                    },
                    "region": {
                        "type": "object",
                        "description": "a GeoJSON Polygon (lon/lat) or a Feature holding one",
                    },
                    "bbox": {
                        "type": "array",
                        "items": {"type": "number"},
                        "minItems": 4,
                        "maxItems": 4,
                    },
                    "partitions": {"type": "integer", "minimum": 0, "maximum": 256},
                    "retention_ms": {"type": "integer", "minimum": 0},
                    "h3_resolution": {
                        "type": "integer",
                        "minimum": 0,
                        "maximum": 15,
                    },
                    "contribution_window_ms": {"type": "integer", "minimum": 0},
                    # give-to-get's minimum contribution (absent: 20 pings over 60 s)
                    "contribution_min_pings": {"type": "integer", "minimum": 1},
                    "contribution_min_seconds": {"type": "integer", "minimum": 0},
                    # self-registered identities' produce:* does not cover it
                    "no_open_produce": {"type": "boolean"},
                },
            }
        ),
        "responses": {
            **_ok(
                "the topic created (or the same one again), with applied_index: "
                "the fence under which every node knows it",
                {
                    "allOf": [
                        _TOPIC,
                        {
                            "type": "object",
                            "properties": {"applied_index": {"type": "integer"}},
                        },
                    ]
                },
                "201",
            ),
            **_errors("400", "409", "413", "503", "504"),
        },
    },
    "DescribeTopic": {
        "summary": "One topic with its partitions",
        "parameters": [_NAME],
        "responses": {**_ok("the topic", _TOPIC), **_errors("400", "404", "503", "504")},
    },
    "Publish": {
        "summary": "Publish pings; a batch with any bad ping is refused whole",
        "parameters": [_NAME],
        "requestBody": _json_body(
            {
                "type": "object",
                "required": ["pings"],
                "properties": {
                    "client_id": {
                        "type": "string",
                        "minLength": 1,
                        "description": "with a token, not needed: the token's identity "
                        "publishes (what this says is not believed); needed only where "
                        "the cluster runs without client identities (client_auth none)",
                    },
                    "pings": {"type": "array", "items": _PING, "minItems": 1},
                    "producer_id": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "idempotence: from POST /v1/producers; "
                        "a (producer_id, sequence) sent again is stored once",
                    },
                    "sequence": {"type": "integer", "minimum": 0},
                    "producer_epoch": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "the epoch POST /v1/producers gave with producer_id "
                        "(0 for a new id); an older one is refused with 409 (fenced)",
                    },
                },
            }
        ),
        "responses": {
            **_ok(
                "where the pings went",
                {
                    "type": "object",
                    "required": ["offsets", "applied_index", "count"],
                    "properties": {
                        "offsets": {"type": "array", "items": {"type": "object"}},
                        "applied_index": {"type": "integer"},
                        "count": {"type": "integer"},
                        "duplicate": {
                            "type": "boolean",
                            "description": "a retry of a (producer_id, sequence) stored "
                            "before: its original offsets",
                        },
                        "group_fences": {
                            "type": "object",
                            "additionalProperties": {"type": "integer"},
                            "description": "a topic placed in data groups: the index each "
                            "group stored its part at (applied_index is then 0)",
                        },
                    },
                },
            ),
            **_errors("400", "404", "409", "413", "503", "504"),
        },
    },
    "InitProducer": {
        "summary": "An idempotent producer id for publishes that may be sent again",
        "requestBody": _json_body(
            {
                "type": "object",
                "required": ["client_id"],
                "properties": {
                    "client_id": {"type": "string", "minLength": 1},
                    "producer_id": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "an id this client holds: keep it under its next "
                        "epoch (a restarted producer resuming it); publishes under older "
                        "epochs are refused from then on",
                    },
                },
            }
        ),
        "responses": {
            **_ok(
                "the producer id: number this producer's publishes 0, 1, 2, ... "
                "(sequence) and send a failed one again as it was",
                {
                    "type": "object",
                    "required": ["producer_id", "epoch"],
                    "properties": {
                        "producer_id": {"type": "integer"},
                        "epoch": {"type": "integer", "description": "send it with each publish"},
                    },
                },
                "201",
            ),
            **_errors("400", "409", "413", "503", "504"),
        },
    },
    "Fetch": {
        "summary": "Read pings of one partition from an offset",
        "parameters": [
            _NAME,
            {
                "name": "partition",
                "in": "path",
                "required": True,
                "schema": {"type": "integer", "minimum": 0},
            },
            {"name": "offset", "in": "query", "schema": {"type": "integer", "minimum": 0}},
            {
                "name": "limit",
                "in": "query",
                "schema": {"type": "integer", "minimum": 1, "maximum": 100000},
            },
        ],
        "responses": {
            **_ok(
                "the pings, in offset order",
                {
                    "type": "object",
                    "required": ["pings", "next_offset", "end_offset"],
                    "properties": {
                        "pings": {"type": "array", "items": _STORED_PING},
                        "next_offset": {"type": "integer"},
                        "end_offset": {"type": "integer"},
                        "first_offset": {"type": "integer"},
                        "served_by": {"type": "string"},
                        "group_fences": _SERVED_GROUP_FENCES,
                        "applied_index": {"type": "integer"},
                    },
                },
            ),
            **_errors("400", "404", "503", "504"),
        },
    },
    "ReadFences": {
        "summary": "Where a read must start from to see every ping acknowledged before it "
        "began: each group's commit index at its leader (a ReadIndex); pass them as "
        "group_fences and min_applied_index to the reads that follow",
        "parameters": [_NAME],
        "responses": {
            **_ok(
                "the fences",
                {
                    "type": "object",
                    "required": ["group_fences", "applied_index"],
                    "properties": {
                        "group_fences": _SERVED_GROUP_FENCES,
                        "applied_index": {"type": "integer"},
                    },
                },
            ),
            **_errors("400", "404", "503", "504"),
        },
    },
    "RegisterClient": {
        "summary": "A phone's own identity: a client id and a token with the scopes "
        "produce:* and heatmap:* (open self-registration: a queue server setting, "
        "limited per source address)",
        "responses": {
            **_ok(
                "the identity: send the token as Authorization: Bearer TOKEN (it is "
                "shown once; the cluster keeps only its hash)",
                {
                    "type": "object",
                    "required": ["client_id", "token"],
                    "properties": {
                        "client_id": {"type": "string"},
                        "token": {"type": "string"},
                        "scopes": {"type": "array", "items": {"type": "string"}},
                        "applied_index": {"type": "integer"},
                    },
                },
                "201",
            ),
            **_errors("400", "403", "503", "504"),
        },
    },
    "GetHeatmap": {
        "summary": "The topic's latest heat map, for clients that contributed lately",
        "parameters": [
            _NAME,
            {"name": "client_id", "in": "query", "schema": {"type": "string"}},
            {
                "name": "window_start_ms",
                "in": "query",
                "schema": {"type": "integer", "minimum": 0},
            },
        ],
        "responses": {
            **_ok(
                "the heat map: one entry per H3 cell",
                {
                    "type": "object",
                    "required": ["cells", "window_start_ms", "window_end_ms"],
                    "properties": {
                        "window_start_ms": {"type": "integer"},
                        "window_end_ms": {"type": "integer"},
                        "h3_resolution": {"type": "integer"},
                        "cells": {"type": "array", "items": {"type": "object"}},
                        "windows": {"type": "array", "items": {"type": "integer"}},
                    },
                },
            ),
            **_errors("400", "403", "404", "503", "504"),
        },
    },
}


_NEEDS = {
    "identity": "any scope",
    "admin": "the scope admin",
    "produce": "the scope produce:TOPIC (or produce:*)",
    "read": "the scope read:TOPIC (or read:*)",
    "heatmap": "the scope heatmap:TOPIC (or heatmap:*); give-to-get applies to its identity",
}


def _paths() -> dict[str, Any]:
    """The paths of the rpcs with an HTTP route; a fenced one takes
    min_applied_index (after its own parameters)."""
    paths: dict[str, Any] = {}
    for rpc in RPCS:
        if rpc.http is None:
            continue
        op: dict[str, Any] = {"operationId": rpc.name, **_OPERATIONS[rpc.name]}
        if rpc.needs == PUBLIC:
            op["security"] = []  # no token needed
        else:  # a token, and (but for identity-only reads) its scope
            op["responses"] = {**op["responses"], **_errors("401", "403")}
            op["description"] = f"Needs a Bearer token with {_NEEDS[rpc.needs]}."
        if rpc.fenced:
            op["parameters"] = [*op.get("parameters", []), _FENCE]
        if "group_fences" in rpc.request.DESCRIPTOR.fields_by_name:
            op["parameters"] = [*op["parameters"], _GROUP_FENCES]
        paths.setdefault(rpc.http.path, {})[rpc.http.method.lower()] = op
    return paths


OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {
        "title": "roadlog",
        "version": "1",
        "description": "GPS pings into geo-fenced topics, replicated with Raft; traffic heat "
        "maps for the clients that contribute pings (give-to-get).",
    },
    "paths": _paths(),
    "security": [{"bearer": []}],
    "components": {
        "schemas": {"Error": _ERROR},
        "securitySchemes": {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "a token the cluster issued: `roadlog client create`, or "
                "POST /v1/clients for a phone",
            }
        },
    },
}
