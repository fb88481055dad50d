"""Idempotent producers in the state machine (applied from the log, so every
replica holds the same ids, epochs and sequences).

A producer id is issued at random by InitProducer (its client id under
``producer/``, when under ``pissued-at/``, listed by age under
``pissued-by-age/``; bound to an authenticated identity under ``pbound/``
and counted for its quota under ``pheld/``, which the apply checks against
the limit the op carries, so every replica refuses the same InitProducer
past it, however many were proposed side by side); a later InitProducer of the
same id takes its next epoch (``pepoch/``), which fences the instance
before. Per partition, ``producers`` keeps each producer's latest
RECENT_SEQUENCES sequences (sequence, base offset, count), so a retried
batch is answered with its original offsets and stored once.

Retention forgets them: a producer's records in a partition none of whose
batches is left (``expire_records``), and an id issued more than
PRODUCER_ID_LIFETIME_MS ago with no record left (``expirable``, proposed by
the leader's trim, then ``drop``).
"""

from __future__ import annotations

import struct
from typing import Any

from node_daemon.state.keys import count_prefix, meta_int
from node_daemon.state.responses import OpResult, publish_responses
from node_daemon.state.topics import DEFAULT_RETENTION_MS
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2, federation_pb2

RECENT_SEQUENCES = 8  # per producer and partition, for retries of pipelined batches

_PROD = struct.Struct(">QII")
_SEQ = struct.Struct(">QQI")
_EPOCH = struct.Struct(">I")
_U64 = struct.Struct(">Q")

_Seq = tuple[int, int, int]  # a producer's sequence, its base offset and count in a partition
_ISSUED_AT, _BY_AGE, _HELD = b"pissued-at/", b"pissued-by-age/", b"pheld/"
# A producer id with no record left is forgotten this long after it was
# issued (a producer that stays away longer asks for a new one).
PRODUCER_ID_LIFETIME_MS = DEFAULT_RETENTION_MS
# Producer ids bound to one identity at once (issue 19's quotas): more is a
# leak or a flood; each costs records on every replica. The default of the
# node's ``producer_ids_per_identity``; the leader puts its own in each
# InitProducerOp (``max_held``), which the apply enforces.
MAX_PRODUCER_IDS_PER_CLIENT = 1024
EXPIRED_PRODUCERS_PER_TRIM = 1000  # keeps a trim entry small
EXPIRY_SCAN_KEYS = 50_000  # producer ids a leader looks at per trim, oldest first


def _issued_key(pid: int) -> bytes:
    """The meta key of a producer id issued at random: its client id."""
    return b"producer/" + _U64.pack(pid)


def _issued_at_key(pid: int) -> bytes:
    """The meta key of when (the log's clock) a producer id was issued."""
    return _ISSUED_AT + _U64.pack(pid)


def _by_age_key(issued_ms: int, pid: int) -> bytes:
    """The meta key that lists producer ids by the time they were issued."""
    return _BY_AGE + _U64.pack(max(issued_ms, 0)) + _U64.pack(pid)


def _held_prefix(client_id: str) -> bytes:
    """The meta keys' prefix of the producer ids bound to ``client_id``."""
    raw = client_id.encode()[:255]
    return _HELD + bytes([len(raw)]) + raw


def _held_key(client_id: str, pid: int) -> bytes:
    """The meta key listing ``pid`` among the producer ids bound to
    ``client_id`` (counted against the identity's quota)."""
    return _held_prefix(client_id) + _U64.pack(pid)


def quota_refusal(held: int) -> RoadlogError:
    """The refusal of a new producer id for an identity that holds ``held``,
    its quota (the leader's, before proposing, and the apply's alike; the
    SDK raises a message with ``quota:`` at once instead of retrying)."""
    return RoadlogError(
        Code.RESOURCE_EXHAUSTED,
        f"producer id quota: this identity holds {held} producer ids, the most one may: "
        f"resume one under its next epoch (InitProducer with its producer_id; an id with "
        f"no pings left is forgotten {PRODUCER_ID_LIFETIME_MS // 86_400_000} days after "
        f"it was issued)",
    )


def _epoch_key(pid: int) -> bytes:
    """The meta key of a producer id's current epoch (absent: 0)."""
    return b"pepoch/" + _U64.pack(pid)


def _seq_record(epoch: int, recent: list[_Seq]) -> bytes:
    """A producer's record in a partition: its latest sequences, under the
    epoch they were sent with. Epoch 0 keeps the layout of before epochs (a
    run of _SEQ); a later epoch leads with it (so the length is 4 past a
    multiple of _SEQ.size, which tells the two apart)."""
    seqs = b"".join(_SEQ.pack(*x) for x in recent[-RECENT_SEQUENCES:])
    return _EPOCH.pack(epoch) + seqs if epoch else seqs


def _parse_seq_record(raw: bytes) -> tuple[int, list[_Seq]]:
    """``_seq_record``'s epoch and sequences."""
    epoch, start = 0, 0
    if len(raw) % _SEQ.size == _EPOCH.size:
        epoch, start = _EPOCH.unpack_from(raw)[0], _EPOCH.size
    return epoch, [_SEQ.unpack_from(raw, i) for i in range(start, len(raw), _SEQ.size)]


def _fenced(pid: int, epoch: int, current: int) -> tuple[Code, str]:
    """The refusal of an append under an epoch that is not producer ``pid``'s
    current one."""
    if epoch < current:
        return (
            Code.FAILED_PRECONDITION,
            f"producer id {pid} is fenced: epoch {epoch} is older than its current "
            f"epoch {current} (another instance took it over with InitProducer)",
        )
    return (
        Code.FAILED_PRECONDITION,
        f"producer id {pid} has no epoch {epoch} yet (its current epoch is {current})",
    )


def _bound_key(pid: int) -> bytes:
    """The meta key marking a producer id issued to an authenticated
    identity (its client id under ``_issued_key``): only it may use it."""
    return b"pbound/" + _U64.pack(pid)


class ProducerTables:
    """Producer ids in ``meta`` and their sequences in ``records`` (the
    ``producers`` database). ``issues`` False: a data group's state, where
    ids are not issued (its leader checks them against group 0's replica)
    and appends take them as checked; ``group``: the Raft group whose state
    this is (a retry's answer carries its fence)."""

    def __init__(self, records: Any, meta: Any, issues: bool = True, group: int = 0) -> None:
        self.records = records
        self.meta = meta
        self.issues = issues
        self.group = group
        self.forget_cached()

    def forget_cached(self) -> None:
        """Drop what the applying thread remembers between applies (the
        state machine's ``_forget``)."""
        self._issued: set[int] = set()  # producer ids known to be issued
        # producer id -> the client id it is bound to ("": not bound), as stored
        self._owners: dict[int, str] = {}

    # ------------------------------------------------------------- applying

    def init(self, txn: Any, op: command_pb2.InitProducerOp, log_ms: int) -> bytes:
        """Apply an InitProducer: the InitProducerResponse."""
        pid = op.producer_id
        if op.next_epoch:
            return self._next_epoch(txn, pid, op.client_id, log_ms)
        if not pid:  # an entry from before random ids: the counter, as then
            pid = meta_int(txn, self.meta, b"next_producer_id") + 1
            txn.put(b"next_producer_id", _U64.pack(pid), db=self.meta)
            return client_pb2.InitProducerResponse(producer_id=pid).SerializeToString()
        if op.bound and op.max_held:
            # The quota where the id is issued (issue 39, finding 5): the
            # leader's check before proposing sees none of the InitProducers
            # still in flight, this one sees every one applied before it.
            held = self.held(txn, op.client_id, op.max_held)
            if held >= op.max_held:
                raise quota_refusal(held)
        if self.issued(txn, pid):
            raise RoadlogError(Code.ABORTED, f"producer id {pid} is taken: ask again")
        txn.put(_issued_key(pid), op.client_id.encode(), db=self.meta)
        txn.put(_issued_at_key(pid), _U64.pack(max(log_ms, 0)), db=self.meta)
        txn.put(_by_age_key(log_ms, pid), b"", db=self.meta)
        if op.bound:
            txn.put(_bound_key(pid), b"", db=self.meta)
            txn.put(_held_key(op.client_id, pid), b"", db=self.meta)
        self._issued.add(pid)
        return client_pb2.InitProducerResponse(producer_id=pid).SerializeToString()

    def spans(
        self,
        txn: Any,
        op: command_pb2.AppendOp,
        tid: int,
        partitions: list[int],
        counts: list[list[int]],
        nxt: list[int],
        index: int,
        results: bool,
        kept: list[bool],
        out: list[OpResult],
    ) -> list[int]:
        """The spans of an append that names producers, one by one: a
        retry of a stored (producer, sequence) is answered with its original
        offsets and left out. Appends to ``kept`` and ``out`` (one each per
        span); returns each part's next offset after the kept spans."""
        for span, row in zip(op.spans, counts, strict=True):
            pid, seq, epoch = span.producer_id, span.sequence, span.producer_epoch
            if pid:
                refused = (
                    self.refusal(txn, pid, span.client_id, epoch=epoch) if self.issues else None
                )
                seen: list[list[_Seq]] = []
                for p, count in zip(partitions, row, strict=True):
                    had, recent = self._sequences(txn, pid, tid, p) if count else (0, [])
                    if had > epoch and refused is None:
                        # A later epoch wrote here (what a data group, which
                        # does not know the epochs, learns from its records).
                        refused = _fenced(pid, epoch, had)
                    seen.append(recent if had == epoch else [])  # a new epoch starts afresh
                if refused is not None:
                    kept.append(False)
                    out.append(OpResult(*refused))
                    continue
                try:
                    dup = _duplicate(pid, seq, partitions, row, seen)
                except RoadlogError as err:
                    kept.append(False)
                    out.append(OpResult(err.code, err.message))
                    continue
                if dup is not None:
                    kept.append(False)
                    # A fence at this entry: it is past where the original was
                    # stored, so a read at it sees the write (read your writes
                    # holds for an answer that came from a retry too).
                    if self.group:
                        dup.group_fences.add(group=self.group, applied_index=index)
                    else:
                        dup.applied_index = index
                    out.append(OpResult(response=dup.SerializeToString()))
                    continue
                for p, base, count, recent in zip(partitions, nxt, row, seen, strict=True):
                    if count:
                        recent.append((seq, base, count))
                        txn.put(
                            _PROD.pack(pid, tid, p), _seq_record(epoch, recent), db=self.records
                        )
            kept.append(True)
            if results:  # applied_index: a read fence
                out.append(
                    OpResult(
                        response=publish_responses(partitions, nxt, [row], index, self.group)[0]
                    )
                )
            nxt = [base + count for base, count in zip(nxt, row, strict=True)]
        return nxt

    def _next_epoch(self, txn: Any, pid: int, client_id: str, log_ms: int) -> bytes:
        """Keep issued producer id ``pid`` for ``client_id`` under its next
        epoch: the InitProducerResponse. Counts as a use: its lifetime starts
        again (``expirable``)."""
        issued = self._issued_in(txn, pid)
        holder = bytes(txn.get(_issued_key(pid), db=self.meta) or b"").decode()
        if not issued or txn.get(_issued_at_key(pid), db=self.meta) is None:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"unknown producer id {pid}: get a new one with InitProducer",
            )
        if holder != client_id:
            raise RoadlogError(
                Code.PERMISSION_DENIED,
                f"producer id {pid} was issued to another client: get your own with InitProducer",
            )
        epoch = self._epoch_in(txn, pid) + 1
        if epoch >= 1 << 32:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"producer id {pid} has used every epoch: get a new one with InitProducer",
            )
        txn.put(_epoch_key(pid), _EPOCH.pack(epoch), db=self.meta)
        at = _U64.unpack(txn.get(_issued_at_key(pid), db=self.meta))[0]
        txn.delete(_by_age_key(at, pid), db=self.meta)
        txn.put(_issued_at_key(pid), _U64.pack(max(log_ms, 0)), db=self.meta)
        txn.put(_by_age_key(log_ms, pid), b"", db=self.meta)
        return client_pb2.InitProducerResponse(producer_id=pid, epoch=epoch).SerializeToString()

    def _epoch_in(self, txn: Any, pid: int) -> int:
        """Producer id ``pid``'s current epoch as ``txn`` says (0: never renewed)."""
        raw = txn.get(_epoch_key(pid), db=self.meta)
        return int(_EPOCH.unpack(raw)[0]) if raw else 0

    def refusal(
        self, txn: Any, pid: int, client_id: str, cached: bool = True, epoch: int = 0
    ) -> tuple[Code, str] | None:
        """Why ``client_id`` may not append with producer id ``pid`` under
        ``epoch`` (None: it may). ``cached`` False: read from ``txn`` alone,
        leaving the applying thread's caches alone (for a reader on another
        thread)."""
        # An owner is read (and, cached, remembered) only once the id is issued.
        if cached:
            issued = self.issued(txn, pid)
            owner = self._owner(txn, pid) if issued else ""
        else:
            issued = self._issued_in(txn, pid)
            owner = self._owner_in(txn, pid) if issued else ""
        if not issued:
            return Code.FAILED_PRECONDITION, f"unknown producer id {pid}: get one with InitProducer"
        if owner and owner != client_id:
            return (
                Code.PERMISSION_DENIED,
                f"producer id {pid} was issued to another client: get your own with InitProducer",
            )
        current = self._epoch_in(txn, pid)
        if epoch != current:
            return _fenced(pid, epoch, current)
        return None

    def issued(self, txn: Any, pid: int) -> bool:
        """Whether producer id ``pid`` was issued by InitProducer: one of the
        counter's (entries from before random ids) or a registered one."""
        if pid in self._issued:
            return True
        if self._issued_in(txn, pid):
            self._issued.add(pid)
            return True
        return False

    def _issued_in(self, txn: Any, pid: int) -> bool:
        """``issued`` as ``txn`` says, without the cache."""
        return pid <= meta_int(txn, self.meta, b"next_producer_id") or bool(
            txn.get(_issued_key(pid), db=self.meta)
        )

    def _owner(self, txn: Any, pid: int) -> str:
        """The client id an issued producer id is bound to ("": not bound,
        any client may use it, as before identities)."""
        owner = self._owners.get(pid)
        if owner is None:
            owner = self._owners[pid] = self._owner_in(txn, pid)
        return owner

    def _owner_in(self, txn: Any, pid: int) -> str:
        """``_owner`` as ``txn`` says, without the cache."""
        if txn.get(_bound_key(pid), db=self.meta) is None:
            return ""
        return bytes(txn.get(_issued_key(pid), db=self.meta) or b"").decode()

    def _sequences(self, txn: Any, pid: int, tid: int, p: int) -> tuple[int, list[_Seq]]:
        """Producer ``pid``'s record in a partition: its epoch and latest sequences."""
        raw = txn.get(_PROD.pack(pid, tid, p), db=self.records)
        return _parse_seq_record(raw) if raw else (0, [])

    # ------------------------------------------------------------ retention

    def drop_topic(self, txn: Any, prefix: bytes) -> None:
        """Every producer's records in the topic whose id packs to ``prefix``."""
        cur = txn.cursor(db=self.records)
        for key in [k for k, _ in cur if k[8:12] == prefix]:
            txn.delete(key, db=self.records)

    def expire_records(self, txn: Any, firsts: dict[tuple[int, int], int]) -> None:
        """Producer records of a partition none of whose batches is stored
        any more (``firsts``: each partition's first offset by topic id and
        partition; a partition not in it is gone): a retry of those could
        only be of pings retention deleted."""
        doomed = []
        for key, raw in txn.cursor(db=self.records):
            _, tid, p = _PROD.unpack(key)
            first = firsts.get((tid, p))
            ends = [base + count for _, base, count in _parse_seq_record(raw)[1]]
            if first is None or max(ends, default=0) <= first:
                doomed.append(bytes(key))
        for key in doomed:
            txn.delete(key, db=self.records)

    def _has_records(self, txn: Any, pid: int) -> bool:
        cur = txn.cursor(db=self.records)
        return bool(cur.set_range(_U64.pack(pid))) and cur.key()[:8] == _U64.pack(pid)

    def drop(self, txn: Any, pid: int) -> None:
        """Forget issued producer id ``pid`` unless a record of it is left."""
        if self._has_records(txn, pid):
            return
        client = bytes(txn.get(_issued_key(pid), db=self.meta) or b"").decode()
        at = txn.get(_issued_at_key(pid), db=self.meta)
        if at is None:
            return  # not issued, forgotten already, or issued before expiry: kept
        txn.delete(_by_age_key(_U64.unpack(at)[0], pid), db=self.meta)
        for key in (_issued_key(pid), _issued_at_key(pid), _bound_key(pid), _epoch_key(pid)):
            txn.delete(key, db=self.meta)
        if client:
            txn.delete(_held_key(client, pid), db=self.meta)
        self._issued.discard(pid)
        self._owners.pop(pid, None)

    # ------------------------------------------------ moves (issue 43)

    def export_topic(self, txn: Any, tid: int) -> list[federation_pb2.MovedProducer]:
        """Every producer with a record in topic ``tid``: its id, holder,
        epoch and records (one full scan of the records: a move's cost, not
        a publish's)."""
        by_pid: dict[int, federation_pb2.MovedProducer] = {}
        for key, raw in txn.cursor(db=self.records):
            pid, t, p = _PROD.unpack(bytes(key))
            if t != tid:
                continue
            mp = by_pid.get(pid)
            if mp is None:
                at = txn.get(_issued_at_key(pid), db=self.meta)
                mp = by_pid[pid] = federation_pb2.MovedProducer(
                    producer_id=pid,
                    client_id=bytes(txn.get(_issued_key(pid), db=self.meta) or b"").decode(),
                    bound=txn.get(_bound_key(pid), db=self.meta) is not None,
                    epoch=self._epoch_in(txn, pid),
                    issued_ms=_U64.unpack(at)[0] if at else 0,
                )
            mp.records.add(partition=p, record=bytes(raw))
        return [by_pid[k] for k in sorted(by_pid)]

    def import_producer(self, txn: Any, mp: federation_pb2.MovedProducer, tid: int) -> None:
        """A moved producer kept under its id (its ``client_id`` already the
        holder here), its records put in topic ``tid``: the same id, epoch
        and sequences, so a retry sent across the move is stored once. An
        id held here by another client is ABORTED (the move fails whole)."""
        pid = mp.producer_id
        if self._issued_in(txn, pid):
            holder = bytes(txn.get(_issued_key(pid), db=self.meta) or b"").decode()
            if holder != mp.client_id:
                raise RoadlogError(Code.ABORTED, f"producer id {pid} is another client's here")
        else:
            txn.put(_issued_key(pid), mp.client_id.encode(), db=self.meta)
            txn.put(_issued_at_key(pid), _U64.pack(max(mp.issued_ms, 0)), db=self.meta)
            txn.put(_by_age_key(mp.issued_ms, pid), b"", db=self.meta)
            if mp.bound:
                txn.put(_bound_key(pid), b"", db=self.meta)
                txn.put(_held_key(mp.client_id, pid), b"", db=self.meta)
        if mp.epoch > self._epoch_in(txn, pid):
            txn.put(_epoch_key(pid), _EPOCH.pack(mp.epoch), db=self.meta)
        for r in mp.records:
            txn.put(_PROD.pack(pid, tid, r.partition), r.record, db=self.records)
        self.forget_cached()

    # ---------------------------------------------------------------- reads

    def expirable(self, txn: Any, lifetime_ms: int, limit: int) -> list[int]:
        """Producer ids issued more than ``lifetime_ms`` before the log's
        clock with no record left (at most ``limit``, the oldest first,
        looking at most at EXPIRY_SCAN_KEYS ids)."""
        out: list[int] = []
        cutoff = meta_int(txn, self.meta, b"log_ms") - lifetime_ms
        cur = txn.cursor(db=self.meta)
        if not cur.set_range(_BY_AGE):
            return out
        for seen, key in enumerate(cur.iternext(keys=True, values=False)):
            if not key.startswith(_BY_AGE) or len(out) >= limit or seen >= EXPIRY_SCAN_KEYS:
                break
            issued_ms, pid = (
                _U64.unpack_from(key, len(_BY_AGE))[0],
                _U64.unpack_from(key, len(_BY_AGE) + 8)[0],
            )
            if issued_ms >= cutoff:
                break  # the rest are younger
            if not self._has_records(txn, pid):
                out.append(pid)
        return out

    def held(self, txn: Any, client_id: str, limit: int) -> int:
        """How many producer ids are bound to ``client_id`` (counted up to
        ``limit``: the quota check needs no more)."""
        return count_prefix(txn, self.meta, _held_prefix(client_id), limit)


def _duplicate(
    pid: int,
    seq: int,
    partitions: list[int],
    row: list[int],
    seen: list[list[tuple[int, int, int]]],
) -> client_pb2.PublishResponse | None:
    """The original answer if producer ``pid``'s ``seq`` (counts ``row`` in
    ``partitions``) was stored before, given the recent sequences ``seen``
    in each partition it has pings in; raises if it is older than those."""
    resp = client_pb2.PublishResponse(duplicate=True)
    for p, count, recent in zip(partitions, row, seen, strict=True):
        if not count:
            continue
        match = [s for s in recent if s[0] == seq]
        if match:
            _, base, stored = match[0]
            resp.offsets.add(partition=p, base_offset=base, count=stored)
        elif recent and seq < recent[-1][0]:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"sequence {seq} of producer {pid} is older than "
                f"the last {RECENT_SEQUENCES} it stored",
            )
        else:
            return None
    return resp
