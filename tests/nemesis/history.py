"""The history of a run: one JSON object a line, like Jepsen's store.

Every event has ``i`` (its line number, from 0), ``t`` (seconds since the
run began, monotonic), ``proc`` (who did it), ``type`` and ``f``.
Operations are ``invoke`` then exactly one of ``ok`` (it happened),
``fail`` (it certainly did not) or ``info`` (unknown: it may have), paired
by ``op``, an id unique in the run. The nemesis and the run's own
observations (final reads, digests, liveness) are single ``info``/``ok``
events without a pair.

Invariant: ``i`` is dense and increasing and ``t`` never decreases (events
are numbered and stamped under one lock, in the order written).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Event = dict[str, Any]


class Recorder:
    """Appends events to ``path``; safe to share between threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "w", buffering=1 << 16)  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._i = 0
        self._ops = itertools.count(1)
        self.invokes: Counter[str] = Counter()  # per f, for progress lines

    def now(self) -> float:
        return time.monotonic() - self._t0

    def event(self, proc: str, type_: str, f: str, **fields: Any) -> Event:
        """Write one event; returns it (with ``i`` and ``t``)."""
        with self._lock:
            ev: Event = {"i": self._i, "t": round(self.now(), 4), "proc": proc, "type": type_}
            ev["f"] = f
            ev.update(fields)
            self._f.write(json.dumps(ev, separators=(",", ":")) + "\n")
            self._i += 1
            if type_ == "invoke":
                self.invokes[f] += 1
            return ev

    def invoke(self, proc: str, f: str, **fields: Any) -> int:
        """Start an operation; returns its ``op`` id for the completion."""
        op = next(self._ops)
        self.event(proc, "invoke", f, op=op, **fields)
        return op

    def complete(self, proc: str, op: int, type_: str, f: str, **fields: Any) -> None:
        assert type_ in ("ok", "fail", "info"), type_
        self.event(proc, type_, f, op=op, **fields)

    def flush(self) -> None:
        with self._lock:
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def load(path: Path) -> list[Event]:
    return list(read(path))


def read(path: Path) -> Iterator[Event]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
