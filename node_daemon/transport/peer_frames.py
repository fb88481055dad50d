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

The greeting (issue 42): before it dials, a node asks the peer's process
where it takes the link (gRPC ``FramesEndpoint``), and both say there
their release and the frame formats they speak, newest and oldest
(``FramesEndpointRequest``/``Reply``: ``release``, ``frames_format``,
``frames_format_oldest``). A frame format is what a frame's payload is:
1, one serialized ``RaftBatch`` (every release so far; its newer fields,
coalesced beats and the op level, are offered or ignored field by field;
the gRPC stream's messages are the same payloads, so the agreement holds
there too).
A peer of a release from before the greeting says nothing (0) and speaks
format 1 alone. The dialer sends in the newest format both speak
(``agreed_format``); where they share none (a peer whose oldest is newer
than ours, or whose newest is older than our oldest) the link is refused
with an error logged, never a crash, and asked again later: Raft sees the
peer as unreachable until one side is upgraded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from roadlog.release import release
from roadlog.runtime import frames
from roadlog.runtime.frames import ServerConn
from roadlog.v1 import raft_pb2

log = logging.getLogger("roadlog.transport")

MAX_FRAME_BYTES = 64 << 20  # as the gRPC peer stream's receive limit
SCHEME = frames.Scheme(b"RLFRAME1", b"roadlog peer frames v1", MAX_FRAME_BYTES)
MAGIC = SCHEME.magic
NONCE_BYTES = frames.NONCE_BYTES
_HELLO = frames.HELLO  # the wire's hello (node id, MAC), for tests that speak it raw

# The frame formats this release speaks (see the greeting above), oldest
# and newest; a new format raises FRAMES_FORMAT, and FRAMES_FORMAT_OLDEST
# only moves once no supported release to upgrade from speaks less.
FRAMES_FORMAT = 1
FRAMES_FORMAT_OLDEST = 1
Formats = tuple[int, int]  # (oldest, newest)
FORMATS: Formats = (FRAMES_FORMAT_OLDEST, FRAMES_FORMAT)


class FormatRefused(Exception):
    """A peer speaks no frame format this release speaks."""


def told_formats(newest: int, oldest: int) -> Formats:
    """What a peer's greeting says it speaks, as (oldest, newest): fields
    absent (0, a release from before the greeting) read as format 1 alone."""
    newest = newest or 1
    return (min(oldest or newest, newest), newest)


def agreed_format(ours: Formats, newest: int, oldest: int) -> int:
    """The format to send to a peer that said (``newest``, ``oldest``):
    the newest both speak. Raises FormatRefused, saying both ranges, when
    they share none."""
    theirs = told_formats(newest, oldest)
    agreed = min(ours[1], theirs[1])
    if agreed < max(ours[0], theirs[0]):
        side = "newer" if theirs[0] > ours[1] else "older"
        raise FormatRefused(
            f"the peer speaks frame formats {theirs[0]}..{theirs[1]}, {side} than this "
            f"release's {ours[0]}..{ours[1]}: upgrade "
            + ("this node" if side == "newer" else "the peer")
        )
    return agreed


class Greetings:
    """One process's side of the greeting, and what its peers said in
    theirs: its request (``request``), its reply's fields (``reply_fields``),
    each peer's release (``releases``; "": one from before the greeting) and
    the format agreed with a peer's reply (``agree``). ``greet`` off: says
    nothing, as a release from before it (for tests). A refusal is logged
    once per peer, release and reason (the link is asked again and again)."""

    def __init__(self, node_id: int, cluster: str) -> None:
        self.node_id = node_id
        self.cluster = cluster
        self.greet = True
        self.formats: Formats = FORMATS
        self.releases: dict[int, str] = {}
        self._refusals_said: set[tuple[int, str, str]] = set()

    def request(self) -> raft_pb2.FramesEndpointRequest:
        if not self.greet:
            return raft_pb2.FramesEndpointRequest(cluster=self.cluster)
        return raft_pb2.FramesEndpointRequest(
            cluster=self.cluster,
            node_id=self.node_id,
            release=release(),
            frames_format=self.formats[1],
            frames_format_oldest=self.formats[0],
        )

    def reply_fields(self) -> dict[str, Any]:
        """``FramesEndpointReply``'s greeting fields ({} with ``greet`` off)."""
        if not self.greet:
            return {}
        return {
            "release": release(),
            "frames_format": self.formats[1],
            "frames_format_oldest": self.formats[0],
        }

    def heard(self, peer: int, said: str) -> None:
        """``peer``'s greeting named ``said`` as its release."""
        if self.releases.get(peer) != said:
            self.releases[peer] = said
            log.info("peer's release", extra={"peer": peer, "release": said or "older"})

    def caller(self, request: raft_pb2.FramesEndpointRequest) -> None:
        """A peer's request (a greeting where it names itself): its release
        kept, a refusal logged where it shares no format with us (it
        refuses the link itself, on our reply)."""
        if not request.node_id:
            return
        self.heard(request.node_id, request.release)
        try:
            agreed_format(self.formats, request.frames_format, request.frames_format_oldest)
        except FormatRefused as e:
            self._refused(request.node_id, request.release, str(e))

    def agree(self, peer: int, reply: raft_pb2.FramesEndpointReply) -> int:
        """The format to send to ``peer`` after its reply (its release
        kept); FormatRefused, logged, when they share none."""
        self.heard(peer, reply.release)
        try:
            return agreed_format(self.formats, reply.frames_format, reply.frames_format_oldest)
        except FormatRefused as e:
            self._refused(peer, reply.release, str(e))
            raise

    def _refused(self, peer: int, said: str, why: str) -> None:
        key = (peer, said, why)
        if key not in self._refusals_said:
            self._refusals_said.add(key)
            log.error(
                "peer link refused: no common frame format",
                extra={"peer": peer, "release": said or "older", "reason": why},
            )


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


__all__ = [
    "FORMATS",
    "FRAMES_FORMAT",
    "FRAMES_FORMAT_OLDEST",
    "FormatRefused",
    "FramesLink",
    "FramesServer",
    "Greetings",
    "agreed_format",
    "frames_key",
    "hello_mac",
    "told_formats",
]
