"""Byte limits on every hop, declared once.

Invariant: each hop accepts more than the hop before it may send, so a
request the front door admits is never refused further in (a refusal deep
inside breaks a stream and takes other clients' work with it):

    client request or response  <= CLIENT_MESSAGE_BYTES     (front door)
    one Work stream message     <= WORK_MESSAGE_BYTES       (queue server <-> node)
    one Raft entry              <= max(ENTRY_BYTES, one op)  (leader -> log)
    one peer stream message     <= PEER_MESSAGE_BYTES       (node <-> node)

and CLIENT_MESSAGE_BYTES + WORK_ENVELOPE_BYTES <= WORK_MESSAGE_BYTES <
PEER_MESSAGE_BYTES. A message that is too big for its hop is refused with
RESOURCE_EXHAUSTED where it enters, never dropped on the way.
"""

from __future__ import annotations

from typing import Final

# One client request, and one answer to a client, at the queue server's
# gRPC API (and what the SDK lets itself send).
CLIENT_MESSAGE_BYTES: Final = 16 << 20
# An HTTP request body at the front door: JSON is bigger than the protobuf
# it becomes, so a body that fits here fits CLIENT_MESSAGE_BYTES.
HTTP_BODY_BYTES: Final = CLIENT_MESSAGE_BYTES
# What a WorkItem or WorkResult adds around the client's bytes.
WORK_ENVELOPE_BYTES: Final = 64 << 10
# One message on a node's Work stream, either way.
WORK_MESSAGE_BYTES: Final = CLIENT_MESSAGE_BYTES + (1 << 20)
# Items (or results) coalesced into one Work stream message: several small
# ones ride together, one bigger than this goes alone.
WORK_BATCH_BYTES: Final = 4 << 20
# Ops packed into one Raft entry: several small ones ride together, one
# bigger than this is an entry of its own.
ENTRY_BYTES: Final = 8 << 20
# One page of a listing (topics): a page closes once it holds this much.
PAGE_BYTES: Final = 4 << 20
MAX_PAGE_SIZE: Final = 1000
# A listing that names no page size gets as much as fits a page: a small
# cluster's whole list, as clients from before paging expect.
DEFAULT_PAGE_SIZE: Final = MAX_PAGE_SIZE
# One message between nodes (Raft, admin, node reads).
PEER_MESSAGE_BYTES: Final = 64 << 20

assert CLIENT_MESSAGE_BYTES + WORK_ENVELOPE_BYTES <= WORK_MESSAGE_BYTES < PEER_MESSAGE_BYTES
assert HTTP_BODY_BYTES <= CLIENT_MESSAGE_BYTES
assert PAGE_BYTES <= CLIENT_MESSAGE_BYTES // 2  # one more item after the bound still fits


def grpc_options(max_bytes: int) -> list[tuple[str, int]]:
    """Channel or server options that send and receive up to ``max_bytes``."""
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


def chunk_by_bytes(sizes: list[int], max_count: int, max_bytes: int) -> list[range]:
    """Split items of the given sizes, in order, into runs of at most
    ``max_count`` items and ``max_bytes`` bytes; an item bigger than
    ``max_bytes`` is a run of its own. Every item is in exactly one run."""
    runs: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= max_count or total + size > max_bytes):
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs
