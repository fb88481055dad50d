"""Fuzzing the HTTP/JSON API from its own OpenAPI document (schemathesis):
whatever a client sends, no 5xx, answers as documented, no process dies and
what was stored before is unchanged."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from queue_server.openapi import OPENAPI
from roadlog.client import Connection, Producer
from roadlog.runtime.processes import alive
from roadlog.tools.localcluster import LocalCluster
from tests.integration.conftest import create_topic, make_pings

pytestmark = pytest.mark.integration

schema = schemathesis.openapi.from_dict(OPENAPI)
SENTINEL = "sentinel-q7x"  # a topic no fuzzer will guess


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, str]]:
    lc = LocalCluster.create(Path(tmp_path_factory.mktemp("fuzz")) / "c", 3, 1)
    lc.start_all()
    try:
        lc.wait_ready(60)
        with Connection(lc.servers) as conn:
            create_topic(conn, "munich")
            create_topic(conn, SENTINEL)
            Producer(conn, SENTINEL, client="s").send_batch(make_pings("s", 0, 500))
        yield lc, lc.queue_servers[0].http
    finally:
        lc.down(grace=3)


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


_state: dict[str, Any] = {}


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_fuzz_http_api(case: Any, api: tuple[LocalCluster, str]) -> None:
    _, base = api
    if "before" not in _state:
        _state["before"] = get(f"{base}/v1/topics/{SENTINEL}")["partition_states"]
    case.call_and_validate(
        base_url=base,
        headers={"X-Timeout-Ms": "10000"},
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )


def test_after_fuzzing_nothing_died_and_nothing_changed(api: tuple[LocalCluster, str]) -> None:
    lc, base = api
    assert "before" in _state, "the fuzz tests did not run"
    assert all(alive(p.pid) for p in [*lc.nodes, *lc.queue_servers])
    after = get(f"{base}/v1/topics/{SENTINEL}")["partition_states"]
    assert after == _state["before"]
    assert sum(p["next_offset"] for p in after) == 500
