"""A state digest names the index it is of (nemesis finding 7).

At the end of a netns run, n1's digest differed from n2's and n3's "at the
same applied index". The Admin StateDigest handler computed the digest on
the apply thread and read ``sm.applied_index`` afterwards, on the event loop:
an entry applied inline in between (small entries are) made it report the
digest of index N as that of N+1. Now the index comes from the digest's own
read transaction."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node_daemon.process.admin import AdminService
from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine
from roadlog.v1 import admin_pb2

pytestmark = pytest.mark.unit


class _ApplyDuringDigest:
    """The state's environment, but the first read transaction (the
    digest's) lets another thread apply one more entry once it is open, as
    the event loop may while the apply thread hashes."""

    def __init__(self, sm: StateMachine) -> None:
        self._sm, self._env, self.fired = sm, sm.env, False

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        txn = self._env.begin(*args, **kwargs)
        if not kwargs.get("write") and not self.fired:
            self.fired = True
            index = self._sm.applied_index + 1
            t = threading.Thread(
                target=self._sm.apply, args=([Entry(1, index, EntryType.NORMAL, b"")],)
            )
            t.start()
            t.join(timeout=30)
            assert not t.is_alive()
        return txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def test_the_digest_reported_is_of_the_index_reported(tmp_path: Path) -> None:
    sm = StateMachine(tmp_path / "state")
    try:
        sm.apply([Entry(1, i, EntryType.NORMAL, b"") for i in (1, 2, 3)])
        at_3 = sm.digest()
        hook = _ApplyDuringDigest(sm)
        sm.env = hook  # type: ignore[assignment]
        io = ThreadPoolExecutor(1)
        service = SimpleNamespace(node=SimpleNamespace(sm=sm, _apply_io=io))
        req = admin_pb2.StateDigestRequest()
        res = asyncio.run(AdminService.StateDigest(service, req, None))  # type: ignore[arg-type]
        io.shutdown()
        assert hook.fired and sm.applied_index == 4  # an entry was applied meanwhile
        assert (res.applied_index, res.sha256) == (3, at_3)
    finally:
        sm.env = getattr(sm.env, "_env", sm.env)  # the real one, to close
        sm.close()
