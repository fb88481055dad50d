"""QueueServer._result: what a node's answer does to the queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from queue_server.config import QueueConfig
from queue_server.node_sessions import MAX_ATTEMPTS
from queue_server.queues import Item, Kind
from queue_server.server import QueueServer
from roadlog.errors import Code
from roadlog.v1 import work_pb2

pytestmark = pytest.mark.unit


def _server_with_a_write(
    tmp_path: Path, item_id: int
) -> tuple[QueueServer, Item, asyncio.Future[work_pb2.WorkResult]]:
    """A queue server with one leader worker and one queued write whose
    client waits on the returned future (call inside a running loop)."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    qs = QueueServer(QueueConfig(secret_file=secret))
    qs.q.connect(1, 1)
    qs.q.grant(1, 1000, 0)
    qs.q.update(1, True, 1, 0)
    item = Item(item_id, Kind.WRITE, "Publish", b"x", 1e12, 0.0, client="c")
    qs.q.submit(item)
    fut: asyncio.Future[work_pb2.WorkResult] = asyncio.get_running_loop().create_future()
    qs._futures[item.id] = fut
    return qs, item, fut


def test_a_write_given_up_after_max_attempts_leaves_the_queue(tmp_path: Path) -> None:
    """Once its client hears UNAVAILABLE, no node may still pick the write up."""

    async def main() -> None:
        qs, item, fut = _server_with_a_write(tmp_path, 7)
        for n in range(MAX_ATTEMPTS):
            handed = qs.q.dispatch(0.0)
            assert [i.id for _, i in handed] == [item.id], f"attempt {n}"
            qs._result(1, work_pb2.WorkResult(id=item.id, code=Code.UNAVAILABLE))
        assert fut.done() and fut.result().code == Code.UNAVAILABLE
        assert qs.q.dispatch(0.0) == []
        assert all(len(q) == 0 for q in qs.q.queues.values())

    asyncio.run(main())


def test_an_unavailable_answer_before_the_limit_requeues_the_write(tmp_path: Path) -> None:
    async def main() -> None:
        qs, item, fut = _server_with_a_write(tmp_path, 8)
        qs.q.dispatch(0.0)
        qs._result(1, work_pb2.WorkResult(id=item.id, code=Code.UNAVAILABLE))
        assert not fut.done()
        assert [i.id for _, i in qs.q.dispatch(0.0)] == [item.id]

    asyncio.run(main())
