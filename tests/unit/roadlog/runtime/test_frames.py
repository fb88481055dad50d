"""The in-place frame reader of framed links: frames come out whole and in
order however the socket splits the bytes; a big frame is read straight
into its own buffer and handed on as that buffer (no copy); the reader never
offers room past the frame being filled; a frame over the limit is refused
before any room is offered for it."""

from __future__ import annotations

import random
import socket
import struct

import pytest

from roadlog.framing import FrameReader, tune_link
from roadlog.runtime import frames

pytestmark = pytest.mark.unit


def _stream(payloads: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in payloads)


def _read_like_a_socket(reader: FrameReader, data: bytes, rng: random.Random) -> list[bytes]:
    """recv_into the offered room, at most a random chunk at a time."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        room = reader.get_buffer()
        assert len(room) > 0
        n = min(len(room), len(data) - pos, rng.choice((1, 3, 4, 100, 4096, 65536, 1 << 20)))
        room[:n] = data[pos : pos + n]
        pos += n
        out += [bytes(f) for f in reader.updated(n)]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_frames_of_every_size_come_out_whole_and_in_order(seed: int) -> None:
    rng = random.Random(seed)
    choices = (0, 1, 7, 300, 5000, 65535, 65536, 65537, 200_000, 700_000)
    sizes = [rng.choice(choices) for _ in range(60)]
    payloads = [rng.randbytes(n) for n in sizes]
    reader = FrameReader(1 << 20)
    assert _read_like_a_socket(reader, _stream(payloads), rng) == payloads
    assert reader.buffered == 0


def test_a_big_frame_is_filled_in_place_and_handed_on_as_its_buffer() -> None:
    reader = FrameReader(1 << 20)
    big = bytes(range(256)) * 1000  # 256,000 bytes
    data = _stream([b"small", big, b"after"])
    room = reader.get_buffer()
    room[:100] = data[:100]  # the small frame and the start of the big one
    assert reader.updated(100) == [b"small"]
    room = reader.get_buffer()
    have = 100 - 9 - 4  # the big one's bytes read so far
    assert len(room) == len(big) - have  # no room past the frame being filled
    room[:] = data[100 : 100 + len(room)]
    [got] = reader.updated(len(room))
    assert isinstance(got, bytearray) and got == big
    assert room.obj is got  # the very buffer the socket filled
    rest = data[100 + len(big) - have :]
    room = reader.get_buffer()
    room[: len(rest)] = rest
    assert reader.updated(len(rest)) == [b"after"]


def test_a_frame_over_the_limit_is_refused_before_room_is_offered_for_it() -> None:
    reader = FrameReader(max_frame=100)
    assert reader.feed(struct.pack("<I", 100) + b"x" * 100) == [b"x" * 100]
    with pytest.raises(ValueError, match="over the limit"):
        reader.feed(struct.pack("<I", 101))


def test_a_framed_links_socket_notices_a_dead_peer_within_seconds() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        tune_link(sock, *frames._Conn.KEEPALIVE)  # as each link's socket is set up
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        got = [
            sock.getsockopt(socket.IPPROTO_TCP, opt)
            for opt in (
                socket.TCP_KEEPIDLE,
                socket.TCP_KEEPINTVL,
                socket.TCP_KEEPCNT,
                socket.TCP_USER_TIMEOUT,
            )
        ]
        assert got == [
            frames.KEEPALIVE_IDLE_S,
            frames.KEEPALIVE_INTERVAL_S,
            frames.KEEPALIVE_COUNT,
            frames.USER_TIMEOUT_MS,
        ]
