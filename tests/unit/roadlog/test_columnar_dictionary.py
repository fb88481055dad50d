"""A batch's device ids decoded once per dictionary: batches that start
with the same dictionary share its decoded ids, and anything else (ids
written after the columns, more ids than the remembered prefix, a memo
that is full) is decoded from the batch itself, never taken from another."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _same(a: columnar.ColumnBytes, b: columnar.ColumnBytes) -> bool:
    return a.n == b.n and a.device_ids == b.device_ids and a.columns == b.columns


def _parsed(data: bytes) -> columnar.ColumnBytes | str:
    try:
        return columnar.parse(data)
    except columnar.BatchDecodeError:
        return "refused"


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 5),
    extra=st.lists(
        st.sampled_from(
            [
                b"\x0a\x00",  # an empty id
                b"\x0a\x05dev-z",  # one more id
                b"\x1a\x00",  # an empty ts_ms
                b"\x32\x00",  # an empty speed_mps
                b"\x48\x01",  # an unknown varint field
                b"\x92\x00\x00",  # device_index with a longer tag than canonical
                b"\x12\x80\x00",  # a length written in two bytes
            ]
        ),
        max_size=3,
    ),
    where=st.integers(0, 1_000),
    cut=st.integers(0, 40),
)
def test_a_remembered_dictionary_never_changes_what_a_batch_parses_to(
    n: int, extra: list[bytes], where: int, cut: int
) -> None:
    """Whatever follows or is spliced into a batch that starts with a
    remembered dictionary (which the memo lets skip the check that the
    view read every byte), the batch parses to what it parses to with no
    dictionary remembered, or is refused by both."""
    ids = ["dev-a", "dev-b"]
    good = _batch(ids, n=max(n, 1))
    columnar._DICTIONARIES.clear()  # each example afresh
    columnar.parse(good)  # remembers the dictionary of a and b
    assert len(columnar._DICTIONARIES) == 1
    at = where % (len(good) + 1)
    data = good[:at] + b"".join(extra) + good[at:]
    data = data[: len(data) - cut % 3] if cut >= 37 else data  # sometimes a cut end
    with_memo = _parsed(data)
    remembered = dict(columnar._DICTIONARIES)
    columnar._DICTIONARIES.clear()
    without = _parsed(data)
    columnar._DICTIONARIES.update(remembered)
    if isinstance(with_memo, str) or isinstance(without, str):
        assert with_memo == without
    else:
        assert _same(with_memo, without)
