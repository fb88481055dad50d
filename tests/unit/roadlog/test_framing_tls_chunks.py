"""A frame over TLS is written as few pieces (``tls_chunks``): each piece a
TLS transport is handed is a record of its own, so a small frame's parts
(length, header, message) go joined, as one; a big part goes as it is; a
plaintext link keeps its writev of the parts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from roadlog.framing import LEN, FramedConn, tls_chunks
from tests.unit.support.loops import run_bounded

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "sizes",
    [[], [4], [4, 30, 2, 60], [4, 10, 100, 10], [4, 100, 5, 100, 3], [4, 99, 1, 100, 7, 250]],
)
def test_the_chunks_are_the_frame_and_small_runs_are_joined(sizes: list[int]) -> None:
    parts = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    got = tls_chunks(parts, limit=100)
    assert b"".join(got) == b"".join(parts)
    assert all(len(c) <= 100 or c in parts for c in got)  # over the limit: a part as it was
    for a, b in itertools.pairwise(got):  # no two neighbours that would have fit in one
        assert len(a) >= 100 or len(b) >= 100 or len(a) + len(b) > 100


def test_a_heartbeat_sized_frame_is_one_piece() -> None:
    assert tls_chunks([LEN.pack(60), b"h" * 20, b"\x0a\x20", b"m" * 38]) == [
        LEN.pack(60) + b"h" * 20 + b"\x0a\x20" + b"m" * 38
    ]


class _Transport:
    def __init__(self, tls: bool) -> None:
        self.tls = tls
        self.written: list[list[bytes]] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return object() if name == "ssl_object" and self.tls else default

    def writelines(self, data: list[bytes]) -> None:
        self.written.append(list(data))


@pytest.mark.parametrize("tls", [True, False])
def test_a_framed_conn_joins_a_frames_parts_over_tls_only(tls: bool) -> None:
    async def body() -> None:
        conn = FramedConn(1 << 20, 0)
        conn.KEEPALIVE = (1, 1, 1, 1000)
        t = _Transport(tls)
        conn.connection_made(t)  # type: ignore[arg-type]
        parts = [b"head", b"\x0a\x05", b"hello"]
        conn.write_parts(parts)
        frame = LEN.pack(11) + b"head\x0a\x05hello"
        assert b"".join(t.written[0]) == frame
        assert t.written[0] == ([frame] if tls else [LEN.pack(11), *parts])

    run_bounded(body)
