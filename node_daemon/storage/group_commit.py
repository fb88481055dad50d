"""Group commit across groups: the log writes that a log store's groups hand
over in one turn of the event loop, persisted in one write transaction with
one fsync (``LogStore.commit``).

``submit`` queues one group's save; the first of a turn schedules the
flush with ``loop.call_soon``, so it runs after every callback already due
in this turn: each group woken in it has handed its write over by then. A
flush runs on the event loop itself when each of its saves may
(``inline``: what ``Replica`` would write on the loop anyway) and the
store's thread is idle; otherwise on the store's thread while the loop goes
on. Saves handed over while a flush is in flight wait for the next, which
begins in the turn that flush is reported done. A round
(``replica.round``) flushes at the end of its pass instead
(``flush_now``), and is told when a flush's saves are reported
(``on_reported``), so their groups go on in that turn.

Invariants: at most one flush is in flight, so saves reach the disk in the
order they were handed over; each save's ``done`` is called exactly once,
on the loop, after the flush's transaction committed (``None``) or failed
(its exception: then none of that flush's saves is stored).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from node_daemon import metrics
from node_daemon.storage.log_store import LogStore, Save

Done = Callable[[BaseException | None], None]


class GroupCommit:
    """The event loop's side of ``store``'s batched writes."""

    def __init__(self, store: LogStore) -> None:
        self.store = store
        self._saves: list[Save] = []
        self._dones: list[Done] = []
        self._inline = True  # every save waiting may be written on the loop
        self._scheduled = False  # a flush is due at the end of this turn
        self._in_flight = False  # a flush runs on the store's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called after a flush's saves are reported done (the round's pass).
        self.on_reported: Callable[[], None] | None = None

    @property
    def groups(self) -> int:
        """How many groups write through here."""
        return len(self.store.logs)

    def submit(self, loop: asyncio.AbstractEventLoop, save: Save, inline: bool, done: Done) -> None:
        """Persist ``save`` with the other saves of this turn; ``done`` once
        durable (or failed)."""
        self._loop = loop
        self._saves.append(save)
        self._dones.append(done)
        self._inline = self._inline and inline
        if not self._scheduled and not self._in_flight:
            self._scheduled = True
            loop.call_soon(self._flush)

    def flush_now(self) -> None:
        """Flush what was handed over, now (unless a flush is in flight: then
        it waits for that one, as ever)."""
        if not self._in_flight:
            self._flush()

    def _flush(self) -> None:
        self._scheduled = False
        if not self._saves or self._in_flight:
            return
        saves, dones, inline = self._saves, self._dones, self._inline
        self._saves, self._dones, self._inline = [], [], True
        metrics.LOG_STORE_SAVES.observe(len(saves))
        if inline and self.store.io.idle:
            try:
                self.store.commit(saves)
            except Exception as e:
                self._report(dones, e)
            else:
                self._report(dones, None)
            if self.on_reported is not None:
                self.on_reported()
            return
        assert self._loop is not None
        self._in_flight = True
        fut = self.store.io.call(self._loop, self.store.commit, saves)
        fut.add_done_callback(lambda f: self._flushed(f, dones))

    def _flushed(self, fut: asyncio.Future[None], dones: list[Done]) -> None:
        self._in_flight = False
        exc = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        self._report(dones, exc)
        if self.on_reported is not None:
            self.on_reported()
        if self._saves and not self._scheduled and not self._in_flight:
            self._scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    @staticmethod
    def _report(dones: list[Done], exc: BaseException | None) -> None:
        for done in dones:
            done(exc)
