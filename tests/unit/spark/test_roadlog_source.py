"""The Spark data source's pieces that need no Spark: stored batches as
Arrow record batches, and finding the node on this host."""

from __future__ import annotations

import numpy as np
import pytest

from roadlog.columnar import PingColumns
from spark.roadlog_source import ARROW_SCHEMA, is_local, to_arrow

pytestmark = pytest.mark.unit


def test_a_stored_batch_becomes_an_arrow_batch_with_offsets() -> None:
    cols = PingColumns.from_columns(
        ["b", "a", "b"], [10, 20, 30], [48.1, 48.2, 48.3], [11.5, 11.6, 11.7],
        speed_mps=[1.0, float("nan"), 3.0],
    )  # fmt: skip
    rb = to_arrow(cols, partition=3, base=100, append_ms=999)
    assert rb.schema == ARROW_SCHEMA
    assert rb.column("offset").to_pylist() == [100, 101, 102]
    assert rb.column("device_id").to_pylist() == ["b", "a", "b"]
    assert rb.column("partition").to_pylist() == [3, 3, 3]
    only = to_arrow(cols, 3, 100, 999, np.array([2]))
    assert only.column("offset").to_pylist() == [102] and only.column("ts_ms").to_pylist() == [30]


def test_the_node_on_this_host_is_found_by_its_address() -> None:
    assert is_local("127.0.0.1:7400")
    assert not is_local("192.0.2.123:7400")  # a documentation address: not this host
    assert not is_local("no-such-host.invalid:7400")
