"""A connection's read fence (read your writes) only ever grows, also when
threads sharing the connection raise it at once."""

from __future__ import annotations

import threading

import pytest

from roadlog.client import Connection

pytestmark = pytest.mark.unit


def test_the_fence_only_grows_whoever_raises_it() -> None:
    conn = Connection(["127.0.0.1:1"])  # never called: channels connect lazily
    try:
        conn.raise_fence(5)
        conn.raise_fence(3)  # an older answer arriving late does not lower it
        assert conn.fence == 5
        indexes = list(range(1, 20_001))
        start = threading.Barrier(8)

        def raise_some(k: int) -> None:
            start.wait()
            for i in indexes[k::8]:
                conn.raise_fence(i)

        threads = [threading.Thread(target=raise_some, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert conn.fence == 20_000
    finally:
        conn.close()
