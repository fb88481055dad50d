"""A batch's device ids decoded once per dictionary: batches that start
with the same dictionary share its decoded ids, and anything else (ids
written after the columns, more ids than the remembered prefix, a memo
that is full) is decoded from the batch itself, never taken from another."""

from __future__ import annotations

import numpy as np
import pytest

from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.v1 import pings_pb2

pytestmark = pytest.mark.unit


def _batch(ids: list[str], n: int = 6, ts: int = 1_700_000_000_000) -> bytes:
    cols = PingColumns.from_columns(
        [ids[i % len(ids)] for i in range(n)],
        np.full(n, ts, dtype=np.int64),
        np.full(n, 48.1),
        np.full(n, 11.5),
    )
    return columnar.encode(cols)


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columnar, "_DICTIONARIES", {})
    monkeypatch.setattr(columnar, "_memo_bytes", 0)


def test_batches_with_one_dictionary_share_its_decoded_ids() -> None:
    ids = ["bus-ü-7", "dev-a", "dev-b"]  # as encode writes them: sorted
    first = columnar.parse(_batch(ids))
    again = columnar.parse(_batch(ids, n=9, ts=1_700_000_000_500))
    assert first.device_ids == ids and again.device_ids is first.device_ids
    assert sorted(set(columnar.join([again]).device_of().tolist())) == ids
    other = columnar.parse(_batch(["dev-a", "dev-c"]))
    assert other.device_ids == ["dev-a", "dev-c"]
    assert len(columnar._DICTIONARIES) == 2


def test_ids_written_after_the_columns_are_read_from_the_batch_itself() -> None:
    ids = ["dev-a", "dev-b"]
    columnar.parse(_batch(ids))  # remembers the dictionary of a and b
    # The same ids first, the columns, then one more id at the end: a
    # batch a foreign writer could send. Its prefix is not the dictionary.
    cols = pings_pb2.PingBatchView.FromString(_batch(ids))
    tail = pings_pb2.PingBatchView(device_ids=["dev-z"]).SerializeToString()
    data = cols.SerializeToString() + tail
    parsed = columnar.parse(data)
    assert parsed.device_ids == ["dev-a", "dev-b", "dev-z"]
    assert len(columnar._DICTIONARIES) == 1  # the odd batch taught it nothing


def test_a_full_memo_remembers_no_more_and_still_decodes_every_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(columnar, "MEMO_DICTIONARY_BYTES", 64)
    for i in range(20):
        ids = [f"dev-{i}-{j}" for j in range(3)]
        assert columnar.parse(_batch(ids)).device_ids == ids
    assert 0 < columnar._memo_bytes <= 64
    assert len(columnar._DICTIONARIES) < 20
