"""Heat maps and contributions in the state machine, and the give-to-get
rule: a client reads a topic's heat maps only if it contributed to the
topic lately. The rule is checked before anything else, so a refusal says
nothing about whether a map exists.

A contribution (issue 39, item 3) is a run of a client's appends to the
topic, no two more than the topic's contribution window apart: the run's
first and last append (the log's clock) and its pings, one record per
(topic, client). It counts once the run holds at least the topic's
``contribution_min_pings`` pings over at least ``contribution_min_seconds``
(first to last append), and its last append lies within the window: a
single made-up ping unlocks nothing. A record from before runs (its last
append alone) reads as a run of one ping at that time.

Retention: a trim op that carries ``heatmap_keep_newest`` (leaders set
``HEATMAP_KEEP_NEWEST``) deletes a topic's heat maps whose window ended
before the log's clock minus the topic's retention (the pings' retention),
but never its newest ``heatmap_keep_newest`` windows, so a quiet topic still
shows its last maps. What is kept depends only on the stored windows and the
trim's clock, so a replica that missed earlier heat-map trims (one of an
earlier release, which ignores the field) holds the same heat maps as the
others once it applies one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from roadlog.contribution import min_pings, min_seconds
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import federation_pb2, heatmaps_pb2, topics_pb2

DEFAULT_CONTRIBUTION_WINDOW_MS = 15 * 60 * 1000
# Heat-map windows of a topic that retention never deletes: the newest 96
# (a day of 15-minute windows, 8 hours of the cron job's 5-minute runs, 96
# minutes of the stream's 60 s triggers).
HEATMAP_KEEP_NEWEST = 96
MAX_CLIENT_ID_BYTES = 128
_TID = struct.Struct(">I")
_WINDOW = struct.Struct(">IQ")
_MS = struct.Struct(">q")
_RUN = struct.Struct(">qqQ")  # last append ms, the run's first append ms, its pings


@dataclass(frozen=True, slots=True)
class Contribution:
    """A client's run of appends to a topic (see the module's doc)."""

    last_ms: int
    start_ms: int
    pings: int

    @classmethod
    def decode(cls, raw: bytes) -> Contribution:
        if len(raw) == _MS.size:  # a record from before runs: one ping, then
            (last,) = _MS.unpack(raw)
            return cls(last, last, 1)
        return cls(*_RUN.unpack(raw))

    def encode(self) -> bytes:
        return _RUN.pack(self.last_ms, self.start_ms, self.pings)

    def then(self, pings: int, at_ms: int, window_ms: int) -> Contribution:
        """This run after ``pings`` more at ``at_ms``: a new run if the last
        append is more than ``window_ms`` before."""
        if at_ms - self.last_ms > window_ms:
            return Contribution(at_ms, at_ms, pings)
        return Contribution(max(self.last_ms, at_ms), self.start_ms, self.pings + pings)


def merged(runs: list[Contribution | None], now_ms: int, window_ms: int) -> Contribution | None:
    """The runs of one client in several groups (a topic placed in data
    groups) as one: those still within the window, their pings summed,
    from the earliest start to the latest append (None: none)."""
    live = [r for r in runs if r is not None and now_ms - r.last_ms <= window_ms]
    if not live:
        return None
    return Contribution(
        max(r.last_ms for r in live), min(r.start_ms for r in live), sum(r.pings for r in live)
    )


class HeatmapTables:
    """The ``contrib`` (topic id, client id -> last contribution ms) and
    ``heatmaps`` (topic id, window start -> HeatMap) databases."""

    def __init__(self, contrib_db: Any, heatmaps_db: Any) -> None:
        self.contrib = contrib_db
        self.heatmaps = heatmaps_db

    def record(
        self, txn: Any, tid: int, pings: dict[str, int], leader_ms: int, window_ms: int
    ) -> None:
        """``pings`` more of each client appended at ``leader_ms``, each
        run carried on or begun (``Contribution.then``)."""
        for c, n in pings.items():
            raw = c.encode()
            if not raw or len(raw) > MAX_CLIENT_ID_BYTES:
                continue
            key = _TID.pack(tid) + raw
            old = txn.get(key, db=self.contrib)
            run = (
                Contribution.decode(bytes(old)).then(n, leader_ms, window_ms)
                if old is not None
                else Contribution(leader_ms, leader_ms, n)
            )
            txn.put(key, run.encode(), db=self.contrib)

    def contribution(self, txn: Any, tid: int, client_id: str) -> Contribution | None:
        """The client's run of appends to the topic (None: none recorded)."""
        if not client_id or len(client_id.encode()) > MAX_CLIENT_ID_BYTES:
            return None
        raw = txn.get(_TID.pack(tid) + client_id.encode(), db=self.contrib)
        return Contribution.decode(bytes(raw)) if raw else None

    def last_contribution(self, txn: Any, tid: int, client_id: str) -> int | None:
        """When the client last appended to the topic (None: not lately)."""
        run = self.contribution(txn, tid, client_id)
        return run.last_ms if run is not None else None

    def put(self, txn: Any, topic: topics_pb2.Topic, hm: heatmaps_pb2.HeatMap) -> None:
        check_heatmap(hm, topic)
        txn.put(
            _WINDOW.pack(topic.id, hm.window_start_ms), hm.SerializeToString(), db=self.heatmaps
        )

    def windows(self, txn: Any, tid: int, newest: int = 0) -> list[int]:
        """The topic's window starts, ascending: every one, or the newest
        ``newest`` (read from the end, so a long history costs nothing)."""
        prefix = _TID.pack(tid)
        out: list[int] = []
        cur = txn.cursor(db=self.heatmaps)
        if newest > 0:
            more = cur.prev() if cur.set_range(_TID.pack(tid + 1)) else cur.last()
            while more and cur.key().startswith(prefix) and len(out) < newest:
                out.append(int(_WINDOW.unpack(cur.key())[1]))
                more = cur.prev()
            return out[::-1]
        if cur.set_range(prefix):
            for k in cur.iternext(keys=True, values=False):
                if not k.startswith(prefix):
                    break
                out.append(int(_WINDOW.unpack(k)[1]))
        return out

    def trim(self, txn: Any, tid: int, cutoff_ms: int, keep_newest: int) -> int:
        """Delete the topic's heat maps whose window ended before
        ``cutoff_ms``, except the newest ``keep_newest`` windows (by window
        start); how many were deleted. Only windows that start before the
        cutoff can have ended before it, so only those are read."""
        if keep_newest <= 0:
            return 0
        prefix = _TID.pack(tid)
        cur = txn.cursor(db=self.heatmaps)
        # The oldest of the newest ``keep_newest`` windows: nothing from it on goes.
        # (set_range past the topic's last key, one back; no key past it: the last.)
        at_end = cur.prev() if cur.set_range(_TID.pack(tid + 1)) else cur.last()
        kept = 0
        while at_end and cur.key().startswith(prefix):
            kept += 1
            if kept == keep_newest:
                break
            at_end = cur.prev()
        if kept < keep_newest:
            return 0  # no more windows than are always kept
        protected = bytes(cur.key())
        doomed = []
        if cur.set_range(prefix):
            for key, raw in cur:
                if key >= protected or _WINDOW.unpack(key)[1] >= cutoff_ms:
                    break
                if heatmaps_pb2.HeatMap.FromString(raw).window_end_ms < cutoff_ms:
                    doomed.append(bytes(key))
        for key in doomed:
            txn.delete(key, db=self.heatmaps)
        return len(doomed)

    def get(self, txn: Any, tid: int, window_start_ms: int) -> heatmaps_pb2.HeatMap | None:
        raw = txn.get(_WINDOW.pack(tid, window_start_ms), db=self.heatmaps)
        return heatmaps_pb2.HeatMap.FromString(raw) if raw else None

    def allowed(
        self,
        txn: Any,
        topic: topics_pb2.Topic,
        client_id: str,
        now_ms: int,
        elsewhere: list[Contribution | None] | None = None,
    ) -> int:
        """The client's last contribution, or PERMISSION_DENIED saying how to
        qualify (see the module's doc). ``elsewhere``: its runs as the
        topic's data groups recorded them (a topic placed in them)."""
        spec = topic.spec
        window = spec.contribution_window_ms or DEFAULT_CONTRIBUTION_WINDOW_MS
        minutes = f"{window / 60000:g} minute(s)"
        need_pings, need_s = min_pings(spec), min_seconds(spec)
        how = (
            f"heat maps of {spec.name!r} are for those who contribute to it: publish at least "
            f"{need_pings} ping(s) inside its region over at least {need_s} s, with no gap "
            f"longer than {minutes}, then ask again within {minutes} of the last"
        )
        if not client_id:
            raise RoadlogError(Code.PERMISSION_DENIED, f"no client_id given; {how}")
        runs = [self.contribution(txn, topic.id, client_id), *(elsewhere or ())]
        run = merged(runs, now_ms, window)
        if run is None:
            raise RoadlogError(
                Code.PERMISSION_DENIED,
                f"client {client_id!r} has not published pings to {spec.name!r} "
                f"in the last {minutes}; {how}",
            )
        spanned_s = (run.last_ms - run.start_ms) / 1000
        if run.pings < need_pings or spanned_s < need_s:
            raise RoadlogError(
                Code.PERMISSION_DENIED,
                f"client {client_id!r} has contributed {run.pings} ping(s) over {spanned_s:g} s "
                f"to {spec.name!r} so far: not enough yet; {how}",
            )
        return run.last_ms

    def expire_contributions(self, txn: Any, tid: int, cutoff_ms: int) -> int:
        """Forget the topic's contributions made before ``cutoff_ms`` (older
        than any contribution window gives access for); how many."""
        prefix = _TID.pack(tid)
        doomed = []
        cur = txn.cursor(db=self.contrib)
        if cur.set_range(prefix):
            for key, raw in cur:
                if not key.startswith(prefix):
                    break
                if _MS.unpack_from(raw)[0] < cutoff_ms:  # the last append, either layout
                    doomed.append(bytes(key))
        for key in doomed:
            txn.delete(key, db=self.contrib)
        return len(doomed)

    def export_rows(self, txn: Any, tid: int) -> list[federation_pb2.MovedRow]:
        """The topic's heat maps (table 1) and contributions (table 2), each
        key past the topic id, for a move."""
        prefix = _TID.pack(tid)
        out = []
        for table, db in ((1, self.heatmaps), (2, self.contrib)):
            cur = txn.cursor(db=db)
            if cur.set_range(prefix):
                for key, value in cur:
                    if not bytes(key).startswith(prefix):
                        break
                    out.append(
                        federation_pb2.MovedRow(
                            table=table, key=bytes(key[len(prefix) :]), value=bytes(value)
                        )
                    )
        return out

    def import_rows(self, txn: Any, tid: int, rows: Any) -> None:
        """Moved rows (``export_rows``'s) put under topic ``tid``."""
        dbs = {1: self.heatmaps, 2: self.contrib}
        for r in rows:
            db = dbs.get(r.table)
            if db is None:
                raise RoadlogError(Code.INVALID_ARGUMENT, f"no moved table {r.table}")
            txn.put(_TID.pack(tid) + r.key, r.value, db=db)

    def drop_topic(self, txn: Any, tid: int) -> None:
        prefix = _TID.pack(tid)
        for db in (self.contrib, self.heatmaps):
            cur = txn.cursor(db=db)
            if cur.set_range(prefix):
                while cur.key().startswith(prefix):
                    if not cur.delete():
                        break


def check_heatmap(hm: heatmaps_pb2.HeatMap, topic: topics_pb2.Topic) -> None:
    c = hm.cells
    n = len(c.h3)
    if hm.window_start_ms < 0 or hm.window_end_ms <= hm.window_start_ms:
        raise RoadlogError(Code.INVALID_ARGUMENT, "a heat map window must end after it starts")
    if hm.h3_resolution > 15:
        raise RoadlogError(Code.INVALID_ARGUMENT, "H3 resolution must be in 0..15")
    if not len(c.pings) == len(c.devices) == len(c.mean_speed_mps) == n:
        raise RoadlogError(Code.INVALID_ARGUMENT, "heat map columns differ in length")
    if len(c.free_flow_mps) not in (0, n) or len(c.congestion) not in (0, n):
        raise RoadlogError(Code.INVALID_ARGUMENT, "heat map columns differ in length")
    if hm.topic and hm.topic != topic.spec.name:
        raise RoadlogError(Code.INVALID_ARGUMENT, "the heat map is of another topic")
