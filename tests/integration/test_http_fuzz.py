"""Fuzzing the HTTP/JSON API from its own OpenAPI document (schemathesis):
whatever a client sends, no 5xx, answers as documented, no process dies and
what was stored before is unchanged."""

from __future__ import annotations

import json
import os
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
from tests.certs import ClusterCA
from tests.integration.conftest import create_topic, make_pings

pytestmark = pytest.mark.integration

schema = schemathesis.openapi.from_dict(OPENAPI)
SENTINEL = "sentinel-q7x"  # a topic no fuzzer will guess


# The sentinel's pings are read back fenced at their write: an unfenced read
# may reach a node that has not applied them yet.
_fence: dict[str, int] = {}


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, test_ca: ClusterCA
) -> Iterator[tuple[LocalCluster, str]]:
    lc = LocalCluster.create(Path(tmp_path_factory.mktemp("fuzz")) / "c", 3, 1, ca=test_ca.signing)
    lc.start_all()
    try:
        lc.wait_ready(60)
        _state["token"] = lc.admin_token  # the fuzzer calls as the admin: past the 401s
        with Connection(lc.servers, tls=lc.tls()) as conn:
            create_topic(conn, "munich")
            create_topic(conn, SENTINEL)
            ack = Producer(conn, SENTINEL, client="s").send_batch(make_pings("s", 0, 500))
            _fence["sentinel"] = ack.applied_index
        assert lc.queue_servers[0].http.startswith("https://")
        yield lc, lc.queue_servers[0].http
    finally:
        lc.down(grace=1)


def get(url: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {_state['token']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _sentinel(base: str) -> str:
    return f"{base}/v1/topics/{SENTINEL}?min_applied_index={_fence['sentinel']}"


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
        _state["before"] = get(_sentinel(base))["partition_states"]
    case.call_and_validate(
        base_url=base,
        headers={"X-Timeout-Ms": "10000", "Authorization": f"Bearer {_state['token']}"},
        verify=os.environ["ROADLOG_CA_FILE"],  # HTTPS: the session's CA (conftest)
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
    after = get(_sentinel(base))["partition_states"]
    assert after == _state["before"]
    assert sum(p["next_offset"] for p in after) == 500
