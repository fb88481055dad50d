"""The framed peer link: Raft batches as length-prefixed frames on a plain
TCP connection run by the event loop itself (``roadlog.runtime.frames``).

It carries exactly what the gRPC ``RaftPeer.Stream`` carries (serialized
``RaftBatch`` messages, one direction per connection: the dialling node
sends, the listening node receives) without gRPC's machinery.

Invariants (beyond those of every framed link):
- A batch that does not parse, one naming another cluster, or a message
  whose ``from`` is not the node that authenticated, closes the connection
  (counted as rejected); the sender reconnects and Raft resends what was
  lost.
- A frame is at most ``MAX_FRAME_BYTES``, as the gRPC peer stream's limit.
"""

from __future__ import annotations

from collections.abc import Callable

from roadlog.runtime import frames
from roadlog.runtime.frames import ServerConn
from roadlog.v1 import raft_pb2

MAX_FRAME_BYTES = 64 << 20  # as the gRPC peer stream's receive limit
SCHEME = frames.Scheme(b"RLFRAME1", b"roadlog peer frames v1", MAX_FRAME_BYTES)
MAGIC = SCHEME.magic
NONCE_BYTES = frames.NONCE_BYTES
_HELLO = frames.HELLO  # the wire's hello (node id, MAC), for tests that speak it raw


def frames_key(secret: bytes, cluster: str) -> bytes:
    """The key that authenticates framed peer links."""
    return SCHEME.key(secret, cluster)


def hello_mac(key: bytes, cluster: str, nonce: bytes, node_id: int) -> bytes:
    return SCHEME.hello_mac(key, cluster, nonce, node_id)


class FramesServer(frames.FramedServer):
    """Accepts framed peer links; ``on_batch`` gets each authenticated batch
    (on the event loop, in the order the peer sent them), ``on_reject`` hears
    of each connection refused or cut off."""

    def __init__(
        self,
        cluster: str,
        secret: bytes,
        on_batch: Callable[[raft_pb2.RaftBatch], None],
        on_reject: Callable[[], None],
    ) -> None:
        super().__init__(SCHEME, cluster, secret, self._open, on_reject)
        self.on_batch = on_batch

    def _open(self, conn: ServerConn) -> frames.OnFrame:
        peer = conn.peer_id

        def receive(data: bytes) -> None:
            batch = raft_pb2.RaftBatch.FromString(data)
            if batch.cluster != self.cluster:
                raise ValueError("a batch of another cluster")
            if getattr(batch, "from") != peer or any(
                getattr(m, "from") != peer for m in batch.messages
            ):
                raise ValueError("a message not from the node that authenticated")
            self.on_batch(batch)

        return receive


class FramesLink:
    """The sending end of one framed peer link (open with ``connect``)."""

    def __init__(self, conn: frames.ClientConn) -> None:
        self._conn = conn

    @classmethod
    async def connect(
        cls, host: str, port: int, cluster: str, secret: bytes, node_id: int
    ) -> FramesLink:
        return cls(await frames.connect(SCHEME, host, port, cluster, secret, node_id))

    @property
    def closed(self) -> bool:
        return self._conn.closed

    async def send(self, payload: bytes) -> None:
        """Queue one frame; waits while the socket's buffer is over its high
        mark. Raises ConnectionError once the link is down."""
        await self._conn.send(payload)

    async def send_parts(self, parts: list[bytes]) -> None:
        """One frame whose payload is ``parts`` joined (they go to the socket
        as they are, not joined here)."""
        await self._conn.send_parts(parts)

    @property
    def writable(self) -> bool:
        """A frame written now goes out without waiting."""
        return self._conn.writable

    def write_parts(self, parts: list[bytes]) -> None:
        """``send_parts`` now (the caller saw ``writable`` this turn)."""
        self._conn.write_parts(parts)

    async def wait_closed(self) -> None:
        await self._conn.wait_closed()

    def close(self) -> None:
        self._conn.abort()


__all__ = ["FramesLink", "FramesServer", "frames_key", "hello_mac"]
