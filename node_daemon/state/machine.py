"""The replicated state machine: topics, ping batches, producers, in LMDB.

Committed Raft entries are applied in one write transaction per call, which
also records the applied index and term, so after a crash the state is
exactly that of some applied index (and re-applying from the log is never
needed for a partial entry). The environment is opened without fsync on
commit: ``checkpoint()`` makes it durable, and must be called before the
Raft log is compacted past what is durable here.

Named databases (keys big-endian, so LMDB orders them numerically):

- ``topics``: name -> Topic (protobuf)
- ``parts``: topic id, partition -> first offset, next offset, last append ms
- ``batches``: topic id, partition, base offset -> header + PingBatch bytes,
  the bytes past a page in ``batchmore`` (``batch_store``)
- ``timeidx``: topic id, partition, append ms, base offset -> b""
- ``producers``: producer id, topic id, partition -> recent (seq, base, count)
- ``meta``: applied index/term, id counters, the log's clock (``log_ms``)
- ``clients``: client identities and their tokens' hashes (``clients.py``)

Everything stored derives from the log alone (times come from the entry's
``leader_ms``), so replicas that applied the same entries are byte-identical
(``digest()``). The log's clock is the highest ``leader_ms`` applied so far:
appends (their batches' times and their clients' contributions) are stamped
with it, and give-to-get measures against it, so a leader whose wall clock
was stepped back neither stamps contributions in the past nor, once set
right, makes fresh ones look old; a node's own wall clock plays no part.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from node_daemon.raft import Entry, EntryType, StorageFullError
from node_daemon.raft.errors import MissingEntryError
from node_daemon.state import batch_refs, batch_store
from node_daemon.state.batch_refs import EntrySource
from node_daemon.state.clients import ClientTables
from node_daemon.state.consumer_groups import GROUP_RETENTION_MS, ConsumerGroupTables
from node_daemon.state.heatmaps import (
    DEFAULT_CONTRIBUTION_WINDOW_MS,
    HEATMAP_KEEP_NEWEST,
    HeatmapTables,
)
from node_daemon.state.keys import count_prefix
from node_daemon.state.paced_copy import copy_paced
from node_daemon.state.responses import publish_responses
from node_daemon.storage import kept_log
from node_daemon.storage.disk import fsync_dir, full_disk_error, open_lmdb
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.geo import RegionError, parse_region
from roadlog.placement import MAX_DATA_GROUPS, group_of, partition_groups
from roadlog.v1 import client_pb2, clients_pb2, command_pb2, groups_pb2, topics_pb2
from roadlog.validation import MAX_PARTITIONS, check_topic_name

GiB = 1 << 30
DEFAULT_PARTITIONS = 8
DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
DEFAULT_H3_RESOLUTION = 9
RECENT_SEQUENCES = 8  # per producer and partition, for retries of pipelined batches

_PART = struct.Struct(">II")
_BATCH = struct.Struct(">IIQ")
_TIME = struct.Struct(">IIQQ")  # unsigned: keys must sort numerically
_PROD = struct.Struct(">QII")
_PART_VAL = struct.Struct(">QQq")
_BATCH_HDR = batch_store.HEADER  # count, append ms
_SEQ = struct.Struct(">QQI")
_EPOCH = struct.Struct(">I")
_U64 = struct.Struct(">Q")


_Seq = tuple[int, int, int]  # a producer's sequence, its base offset and count in a partition
_PEER = struct.Struct(">5sQ")  # b"peer/" + node id: the replicated address book
# Operations that write topic records or partition states other than by appending.
_FORGETTING = frozenset({"create_topic", "delete_topic", "trim", "place_topic"})
_ISSUED_AT, _BY_AGE, _HELD = b"pissued-at/", b"pissued-by-age/", b"pheld/"
# A producer id with no record left is forgotten this long after it was
# issued (a producer that stays away longer asks for a new one).
PRODUCER_ID_LIFETIME_MS = DEFAULT_RETENTION_MS
# Producer ids bound to one identity at once (issue 19's quotas): more is a
# leak or a flood; each costs records on every replica.
MAX_PRODUCER_IDS_PER_CLIENT = 1024
EXPIRED_PRODUCERS_PER_TRIM = 1000  # keeps a trim entry small
EXPIRY_SCAN_KEYS = 50_000  # producer ids a leader looks at per trim, oldest first
# The state's on-disk layout: 1, batches stored whole; 2, in pieces of a page
# (``batch_store``); 3, as references into the Raft log where the node's log
# is open to it (``batch_refs``). Each reads the earlier ones' too. A state
# of a later format (a newer release's) is refused, not misread.
STATE_FORMAT = 3
_FORMAT_KEY = b"state_format"  # in meta; local to the replica, not in the digest


class StateFormatError(Exception):
    """The state on disk was written by a newer release of roadlog."""


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


@dataclass(slots=True)
class OpResult:
    """What the proposer tells the client about one operation."""

    code: Code = Code.OK
    message: str = ""
    response: bytes = b""
    # An append op's result per span (publish request), in span order; the
    # op's own code is OK then, and each span says how it went.
    spans: tuple[OpResult, ...] = ()


@dataclass(frozen=True, slots=True)
class PartitionState:
    first_offset: int
    next_offset: int
    last_append_ms: int


@dataclass(frozen=True, slots=True)
class TopicFigures:
    """A topic as monitoring sees it (``StateMachine.monitoring_figures``)."""

    name: str
    appended: int  # pings ever appended: the sum of its partitions' next offsets
    kept: int  # pings still stored (retention trimmed the others)
    heatmap_computed_ms: int  # when its latest heat map was computed; 0: none yet
    heatmap_window_end_ms: int  # the end of that heat map's window; 0: none yet


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """A consumer group as monitoring sees it."""

    name: str
    topic: str
    lag: int  # pings of its topic past its committed offsets (not yet read and committed)


class StateMachine:
    def __init__(
        self,
        path: str | os.PathLike[str],
        map_size: int = 4 * GiB,
        issues_producers: bool = True,
        group: int = 0,
        readonly: bool = False,
        entries: EntrySource | None = None,
    ) -> None:
        """``entries``: the node's Raft log for this group. With it, a
        batch appended as it came is stored as a reference to its bytes in
        the entry that carried them (``batch_refs``: one copy per node) and
        read from there; without it (a state opened alone), batches are
        stored as bytes, and a reference read is an error.
        ``issues_producers`` False: a data group's state, where producer
        ids are not issued; its leader checks them against group 0's replica
        (``producer_refusal``) before proposing, and applies take them as
        checked. ``group``: the Raft group whose state this is; a data
        group's publish answers carry their index as that group's fence
        (``group_fences``), not as ``applied_index`` (group 0's).
        ``readonly``: a view of a replica another process applies
        (``replica_view``): reads only, and ``applied_index`` is as of the
        opening (``stored_applied_index`` reads it afresh)."""
        self.path = Path(path)
        self.readonly = readonly
        self.map_size = map_size
        self.issues_producers = issues_producers
        self.group = group
        self.entries = entries
        # Set when retention or a topic's deletion removed batches stored as
        # references: the log may let their entries go at its next
        # compaction, which is then due (``Snapshots``); cleared by it.
        self.refs_released = False
        # Moved by every apply and by every _forget (a snapshot installed, a
        # failed transaction): answers told at one generation hold at it.
        self.generation = 0
        self._open()

    def _open(self) -> None:
        if not self.readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self.env = open_lmdb(  # a full disk: StorageFullError, not a SIGBUS
            self.path,
            "state",
            map_size=self.map_size,
            max_dbs=16,
            sync=False,
            metasync=False,
            readahead=False,
            readonly=self.readonly,
        )

        def db(name: bytes) -> Any:
            return self.env.open_db(name, create=not self.readonly)

        if not self.readonly:
            # Readers of this state in other processes (worker processes,
            # the main process: ``replica_view``) that died left their slots
            # in the lock file, which would pin old pages for good.
            self.env.reader_check()

        self.topics, self.parts, self.batches = db(b"topics"), db(b"parts"), db(b"batches")
        self._more: Any = None
        self._open_pieces()
        self.timeidx, self.producers, self.meta = db(b"timeidx"), db(b"producers"), db(b"meta")
        self.consumer_groups = ConsumerGroupTables(db(b"groups"), db(b"offsets"), self.meta)
        self.heat = HeatmapTables(db(b"contrib"), db(b"heatmaps"))
        self.clients = ClientTables(db(b"clients"), self.meta)
        with self.env.begin() as txn:
            stored_format = self._meta_int(txn, _FORMAT_KEY)
            self.applied_index = self._meta_int(txn, b"applied_index")
            self.applied_term = self._meta_int(txn, b"applied_term")
            self.log_ms = self._meta_int(txn, b"log_ms")  # 0: nothing applied yet
        try:
            _refuse_newer(self.path, stored_format)
        except StateFormatError:
            self.env.close()
            raise
        if not self.readonly and stored_format < STATE_FORMAT:
            with self.env.begin(write=True) as txn:
                txn.put(_FORMAT_KEY, _U64.pack(STATE_FORMAT), db=self.meta)
        self._log_ms = self.log_ms  # while an apply's transaction is open
        self._forget()

    def _forget(self) -> None:
        """Drop what appends remember between applies (see ``_append``)."""
        self.generation += 1
        # Only the applying thread reads or writes these, always mirroring
        # what its transactions wrote: a topic record by name, and a
        # partition's state by (topic id, partition). Whatever else writes
        # the topics or partition states (creating, deleting, trimming, a
        # failed transaction, a snapshot installed) forgets them all.
        self._topics: dict[str, topics_pb2.Topic] = {}
        self._states: dict[tuple[int, int], PartitionState] = {}
        self._issued: set[int] = set()  # producer ids known to be issued
        # The cluster's data groups once recorded (it never changes after: the
        # write path asks on every call); 0: not recorded yet.
        self._groups_recorded = 0
        # producer id -> the client id it is bound to ("": not bound), as stored
        self._owners: dict[int, str] = {}

    def _open_pieces(self) -> None:
        """Open ``batchmore`` (creating it unless read-only). A read-only
        view of a replica whose writer has not created it yet tries again
        before each read transaction: a transaction can only use databases
        opened before it began (``batch_store.PiecesNotOpen``)."""
        if self._more is None:
            with contextlib.suppress(lmdb.NotFoundError):  # read-only, not there yet
                self._more = self.env.open_db(batch_store.MORE_NAME, create=not self.readonly)

    def _meta_int(self, txn: Any, key: bytes) -> int:
        raw = txn.get(key, db=self.meta)
        return int(_U64.unpack(raw)[0]) if raw else 0

    def close(self) -> None:
        self.env.close()

    # ------------------------------------------------------------- applying

    def apply(self, entries: Sequence[Entry], results: bool = True) -> list[list[OpResult]]:
        """Apply committed entries in one transaction; one list of results
        (one per operation) per entry. Entries at or below the applied index
        are skipped (they were applied before a crash). ``results=False``:
        nobody waits for these entries' answers (a follower's applies), so
        none are built and every list is empty; what is stored is the same."""
        out: list[list[OpResult]] = []
        todo = [e for e in entries if e.index > self.applied_index]
        if not todo:
            return [[] for _ in entries]
        self.generation += 1  # what answers() told before this is stale now
        self._log_ms = self.log_ms
        try:
            with self.env.begin(write=True) as txn:
                for e in todo:
                    res = self._apply_entry(txn, e, results)
                    out.append(res if results else [])
                last = todo[-1]
                txn.put(b"applied_index", _U64.pack(last.index), db=self.meta)
                txn.put(b"applied_term", _U64.pack(last.term), db=self.meta)
                if self._log_ms != self.log_ms:
                    txn.put(b"log_ms", _U64.pack(self._log_ms), db=self.meta)
        except BaseException as e:
            self._forget()  # the transaction is gone, and what it wrote
            self._log_ms = self.log_ms
            if isinstance(e, lmdb.Error):
                self._storage_error(e)
            raise
        self.applied_index, self.applied_term = todo[-1].index, todo[-1].term
        self.log_ms = self._log_ms
        skipped: list[list[OpResult]] = [[] for _ in range(len(entries) - len(todo))]
        return skipped + out

    def answers(self, entries: Sequence[Entry]) -> list[list[OpResult]] | None:
        """What ``apply(entries)`` will answer, found without storing or
        reading anything, where what appends remember (``_topics`` and
        ``_states``) is enough: every entry not yet applied holds only
        appends without idempotent producers, to topics and partitions
        remembered. Else None (then only ``apply`` can tell).

        Nothing changes the state between this and the ``apply`` of the
        same entries: entries are applied in order, one call at a time, and
        what appends remember always mirrors what is stored. So ``apply``
        answers the same (tested), and a leader can send these as soon as
        the entries commit and store them after (``Replica._apply_job``),
        or tell them while the entries are being written, valid while
        ``generation`` (moved by every apply and every ``_forget``) stays
        what it was when they were told."""
        out: list[list[OpResult]] = []
        tails: dict[tuple[int, int], int] = {}  # next offsets after the entries before
        todo = [e.index for e in entries if e.index > self.applied_index]
        if todo and todo[0] != self.applied_index + 1:
            return None  # entries missing in between: their effect is unknown here
        for e in entries:
            if e.index <= self.applied_index or e.type != EntryType.NORMAL or not e.data:
                out.append([])
                continue
            try:
                cmd = command_pb2.Command.FromString(e.data)
            except Exception:
                return None
            results = []
            for op in cmd.ops:
                if op.WhichOneof("op") != "append":
                    return None
                try:
                    spans = self._plain_answers(op.append, e.index, tails)
                except RoadlogError as err:
                    results.append(OpResult(err.code, err.message))
                    continue
                if spans is None:
                    return None
                results.append(OpResult(spans=spans))
            out.append(results)
        return out

    def _plain_answers(
        self, op: command_pb2.AppendOp, index: int, tails: dict[tuple[int, int], int]
    ) -> tuple[OpResult, ...] | None:
        """``_append``'s answers to an append without idempotent producers,
        from what appends remember (None: not all of it is remembered, or
        the op names producers), raising as ``_append`` does before it
        stores anything; ``tails`` are moved past the op's pings."""
        topic = self._topics.get(op.topic)
        if topic is None or any(span.producer_id for span in op.spans):
            return None
        _check_topic_id(op, topic)
        tid = topic.id
        counts = [list(span.counts) for span in op.spans]
        _check_layout(op, counts, topic.spec.partitions)
        partitions = [part.partition for part in op.parts]
        bases = []
        for p in partitions:
            base = tails.get((tid, p))
            if base is None:
                st = self._states.get((tid, p))
                if st is None:
                    return None
                base = st.next_offset
            bases.append(base)
        answers = publish_responses(partitions, bases, counts, index, self.group)
        for p, base, part in zip(partitions, bases, op.parts, strict=True):
            tails[tid, p] = base + part.count
        return tuple(OpResult(response=r) for r in answers)

    def _storage_error(self, e: lmdb.Error) -> None:
        if isinstance(e, lmdb.MapFullError):
            raise StorageFullError(
                f"state machine map full at {self.map_size} bytes in {self.path}"
            ) from None
        if full_disk_error(e, self.path):  # ENOSPC, or a commit cut short (EIO)
            raise StorageFullError(f"disk full in {self.path}: {e}") from e

    def _apply_entry(self, txn: Any, e: Entry, results: bool = True) -> list[OpResult]:
        if e.type != EntryType.NORMAL or not e.data:
            return []  # configuration changes and the leader's empty entries
        try:
            cmd = command_pb2.Command.FromString(e.data)
        except Exception:
            return [OpResult(Code.INTERNAL, "undecodable command")]
        self._log_ms = max(self._log_ms, cmd.leader_ms)  # the log's clock never goes back
        out = []
        where: list[list[tuple[int, int]]] | None = None  # each op's batches in e.data
        if self.entries is not None:
            where = batch_refs.append_batch_spans(e.data)
            if where is not None and len(where) != len(cmd.ops):
                where = None
        for n, op in enumerate(cmd.ops):
            try:
                kind = op.WhichOneof("op")
                if kind == "append":
                    at = (e.data, where[n]) if where is not None else None
                    spans = self._append(txn, op.append, self._log_ms, e.index, results, at)
                    out.append(OpResult(spans=tuple(spans)))
                else:
                    if kind in _FORGETTING:
                        self._forget()
                    out.append(OpResult(response=self._apply_op(txn, op, cmd.leader_ms, e.index)))
            except RoadlogError as err:
                out.append(OpResult(err.code, err.message))
        return out

    def _apply_op(self, txn: Any, op: command_pb2.Op, leader_ms: int, index: int) -> bytes:
        kind = op.WhichOneof("op")
        if kind == "create_topic":
            desc = self._create_topic(
                txn, op.create_topic.spec, leader_ms, op.create_topic.data_groups
            )
            desc.applied_index = index  # read your writes: describe and list see it
            return desc.SerializeToString()
        if kind == "delete_topic":
            self._delete_topic(txn, op.delete_topic.name)
            return client_pb2.DeleteTopicResponse(
                deleted=True, applied_index=index
            ).SerializeToString()
        if kind == "place_topic":
            self._place_topic(txn, op.place_topic.topic)
            return b""
        if kind == "init_producer":
            pid = op.init_producer.producer_id
            if op.init_producer.next_epoch:
                return self._next_epoch(txn, pid, op.init_producer.client_id)
            if not pid:  # an entry from before random ids: the counter, as then
                pid = self._meta_int(txn, b"next_producer_id") + 1
                txn.put(b"next_producer_id", _U64.pack(pid), db=self.meta)
                return client_pb2.InitProducerResponse(producer_id=pid).SerializeToString()
            if self.producer_issued(txn, pid):
                raise RoadlogError(Code.ABORTED, f"producer id {pid} is taken: ask again")
            txn.put(_issued_key(pid), op.init_producer.client_id.encode(), db=self.meta)
            txn.put(_issued_at_key(pid), _U64.pack(max(self._log_ms, 0)), db=self.meta)
            txn.put(_by_age_key(self._log_ms, pid), b"", db=self.meta)
            if op.init_producer.bound:
                txn.put(_bound_key(pid), b"", db=self.meta)
                txn.put(_held_key(op.init_producer.client_id, pid), b"", db=self.meta)
            self._issued.add(pid)
            return client_pb2.InitProducerResponse(producer_id=pid).SerializeToString()
        if kind == "trim":
            self._trim(txn, leader_ms)
            if op.trim.heatmap_keep_newest:  # 0: an entry from before heat-map retention
                self._trim_heatmaps(txn, self._log_ms, op.trim.heatmap_keep_newest)
            if op.trim.expire_records:  # false: an entry from before record expiry
                self._expire_records(txn, self._log_ms)
            for pid in op.trim.expired_producers:
                self._forget_producer(txn, pid)
            if op.trim.group_retention_ms:  # 0: an entry from before group expiry
                self.consumer_groups.expire(txn, self._log_ms - op.trim.group_retention_ms)
            return b""
        if kind == "add_peer":
            ap = op.add_peer
            if not ap.node_id or not ap.address or len(ap.address) > 255:
                raise RoadlogError(Code.INVALID_ARGUMENT, "a peer needs an id and an address")
            txn.put(_PEER.pack(b"peer/", ap.node_id), ap.address.encode(), db=self.meta)
            return b""
        if kind == "join_group":
            req = op.join_group.request
            topic = self._topic(txn, req.topic)
            resp = self.consumer_groups.join(
                txn, req, topic.spec.partitions, leader_ms, index, op.join_group
            )
            return resp.SerializeToString()
        if kind == "leave_group":
            g = self.consumer_groups.get(txn, op.leave_group.group)
            nparts = self._topic(txn, g.topic).spec.partitions if g is not None else 0
            gen = self.consumer_groups.leave(
                txn, op.leave_group.group, list(op.leave_group.member_ids), nparts, self._log_ms
            )
            return client_pb2.LeaveGroupResponse(generation=gen).SerializeToString()
        if kind == "commit_offsets":
            commit = op.commit_offsets.request
            g = self.consumer_groups.get(txn, commit.group)
            if g is None:
                raise RoadlogError(Code.NOT_FOUND, f"no group {commit.group!r}")
            topic = self._topic(txn, g.topic)
            # A topic placed in data groups: its ends are theirs, which this
            # group's apply cannot read alike on every replica; its leader
            # checked the offsets against them before proposing.
            ends = (
                None
                if topic.partition_groups
                else {
                    o.partition: self._part_state(txn, topic.id, o.partition).next_offset
                    for o in commit.offsets
                    if o.partition < topic.spec.partitions
                }
            )
            self.consumer_groups.commit(txn, commit, ends, leader_ms, topic.spec.partitions)
            return client_pb2.CommitOffsetsResponse(applied_index=index).SerializeToString()
        if kind == "release_partitions":
            rel = op.release_partitions
            g = self.consumer_groups.get(txn, rel.group)
            if g is not None:
                nparts = self._topic(txn, g.topic).spec.partitions
                self.consumer_groups.release(
                    txn, rel.group, rel.member_id, list(rel.partitions), nparts
                )
            return b""
        if kind == "delete_group":
            self.consumer_groups.delete(txn, op.delete_group.group)
            return client_pb2.DeleteGroupResponse(
                deleted=True, applied_index=index
            ).SerializeToString()
        if kind == "put_heatmap":
            hm = op.put_heatmap.request.heatmap
            self.heat.put(txn, self._topic(txn, hm.topic), hm)
            return client_pb2.PutHeatmapResponse(applied_index=index).SerializeToString()
        if kind == "create_client":
            cc = op.create_client
            ident = self.clients.create(txn, cc.identity, cc.token_hash, self._log_ms)
            return clients_pb2.CreateClientResponse(
                client_id=ident.client_id, identity=ident, applied_index=index
            ).SerializeToString()
        if kind == "revoke_client":
            self.clients.revoke(txn, op.revoke_client.name)
            return clients_pb2.RevokeClientResponse(
                revoked=True, applied_index=index
            ).SerializeToString()
        raise RoadlogError(Code.INVALID_ARGUMENT, f"unknown operation {kind!r}")

    # --------------------------------------------------------------- topics

    def _create_topic(
        self, txn: Any, spec: topics_pb2.TopicSpec, leader_ms: int, data_groups: int = 0
    ) -> topics_pb2.TopicDescription:
        spec = normalized_spec(spec)
        existing = txn.get(spec.name.encode(), db=self.topics)
        if existing is not None:
            topic = topics_pb2.Topic.FromString(existing)
            if topic.spec == spec:
                return self._describe(txn, topic)  # the same request again
            raise RoadlogError(Code.ALREADY_EXISTS, f"topic {spec.name!r} already exists")
        tid = self._meta_int(txn, b"next_topic_id") + 1
        groups = self._data_groups(txn, data_groups, first_topic=tid == 1)
        txn.put(b"next_topic_id", _U64.pack(tid), db=self.meta)
        region = parse_region(spec.region_geojson)
        topic = topics_pb2.Topic(
            spec=spec,
            id=tid,
            created_ms=leader_ms,
            bbox=region.bbox,
            partition_groups=partition_groups(tid, spec.partitions, groups),
        )
        txn.put(spec.name.encode(), topic.SerializeToString(), db=self.topics)
        for p in range(spec.partitions):
            txn.put(_PART.pack(tid, p), _PART_VAL.pack(0, 0, 0), db=self.parts)
        return self._describe(txn, topic)

    def _place_topic(self, txn: Any, topic: topics_pb2.Topic) -> None:
        """In a data group: record group 0's topic as it is (its id kept),
        with empty partitions; the same record again changes nothing. A
        topic of the same name but another id (deleted and made again in
        group 0) is refused: the group drops the old one first."""
        if not topic.id or not topic.spec.name or topic.spec.partitions <= 0:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a placed topic needs its id and spec")
        existing = txn.get(topic.spec.name.encode(), db=self.topics)
        if existing is not None:
            if topics_pb2.Topic.FromString(existing).id == topic.id:
                return
            raise RoadlogError(
                Code.FAILED_PRECONDITION, f"topic {topic.spec.name!r} here has another id"
            )
        txn.put(topic.spec.name.encode(), topic.SerializeToString(), db=self.topics)
        for p in range(topic.spec.partitions):
            txn.put(_PART.pack(topic.id, p), _PART_VAL.pack(0, 0, 0), db=self.parts)

    def _data_groups(self, txn: Any, proposed: int, first_topic: bool) -> int:
        """The cluster's number of data groups. The first topic ever made
        records the value its leader proposed (at least 1) and every later
        topic is placed by it, whatever later leaders propose; a cluster
        with topics from before groups has one."""
        recorded = self._meta_int(txn, b"data_groups")
        if recorded:
            return recorded
        if not first_topic:
            return 1
        recorded = min(max(proposed, 1), MAX_DATA_GROUPS)
        txn.put(b"data_groups", _U64.pack(recorded), db=self.meta)
        return recorded

    def founded_data_groups(self) -> int | None:
        """The data groups the cluster was founded with, as its first topic
        recorded them (1 for a cluster whose topics came before groups);
        None before the first topic, when that is not decided yet."""
        with self.env.begin() as txn:
            recorded = self._meta_int(txn, b"data_groups")
            if recorded:
                return recorded
            return 1 if self._meta_int(txn, b"next_topic_id") else None

    def data_groups(self) -> int:
        """The recorded number of data groups (1 before the first topic)."""
        if not self._groups_recorded:
            with self.env.begin() as txn:
                self._groups_recorded = self._meta_int(txn, b"data_groups")
        return self._groups_recorded or 1

    def _delete_topic(self, txn: Any, name: str) -> None:
        raw = txn.get(name.encode(), db=self.topics)
        if raw is None:
            raise RoadlogError(Code.NOT_FOUND, f"no topic {name!r}")
        topic = topics_pb2.Topic.FromString(raw)
        prefix = struct.pack(">I", topic.id)
        if self.entries is not None:
            self.refs_released = True  # its log entries may go (if nothing else refers to them)
        for db in (self.parts, self.batches, self._more, self.timeidx):
            _delete_prefix(txn, db, prefix)
        cur = txn.cursor(db=self.producers)
        for key in [k for k, _ in cur if k[8:12] == prefix]:
            txn.delete(key, db=self.producers)
        self.heat.drop_topic(txn, topic.id)
        self.consumer_groups.drop_topic(txn, name)
        txn.delete(name.encode(), db=self.topics)

    def _topic(self, txn: Any, name: str) -> topics_pb2.Topic:
        try:
            check_topic_name(name)  # also keeps LMDB from an empty or oversized key
        except ValueError as e:
            raise RoadlogError(Code.INVALID_ARGUMENT, str(e)) from None
        raw = txn.get(name.encode(), db=self.topics)
        if raw is None:
            raise RoadlogError(Code.NOT_FOUND, f"no topic {name!r}")
        return topics_pb2.Topic.FromString(raw)

    def _part_state(self, txn: Any, tid: int, p: int) -> PartitionState:
        raw = txn.get(_PART.pack(tid, p), db=self.parts)
        if raw is None:
            raise RoadlogError(Code.NOT_FOUND, f"no partition {p}")
        return PartitionState(*_PART_VAL.unpack(raw))

    def _describe(self, txn: Any, topic: topics_pb2.Topic) -> topics_pb2.TopicDescription:
        d = topics_pb2.TopicDescription(topic=topic)
        for p in range(topic.spec.partitions):
            st = self._part_state(txn, topic.id, p)
            d.partitions.add(
                partition=p,
                first_offset=st.first_offset,
                next_offset=st.next_offset,
                last_append_ms=st.last_append_ms,
                group=group_of(topic, p),
            )
        return d

    # --------------------------------------------------------------- append

    def _append(
        self,
        txn: Any,
        op: command_pb2.AppendOp,
        leader_ms: int,
        index: int,
        results: bool = True,
        at: tuple[bytes, list[tuple[int, int]]] | None = None,
    ) -> list[OpResult]:
        """Store the op's parts; one result per span (none if ``results`` is
        False). ``at``: the entry's data and where each part's batch lies in
        it; a batch stored as it came and found there is stored as a
        reference to entry ``index`` (one copy per node), any other as
        bytes. A span that is a retry of a stored (producer, sequence) is
        answered with its original offsets and its pings are left out of
        what is stored. The topic and the partitions' states are remembered
        from one append to the next (``_forget``)."""
        topic = self._topics.get(op.topic)
        if topic is None:
            topic = self._topics[op.topic] = self._topic(txn, op.topic)
        _check_topic_id(op, topic)
        tid, nparts = topic.id, topic.spec.partitions
        counts = [list(span.counts) for span in op.spans]
        _check_layout(op, counts, nparts)
        partitions = [part.partition for part in op.parts]
        states = [self._state(txn, tid, p) for p in partitions]
        nxt = [st.next_offset for st in states]
        kept: list[bool] = []  # per span, with producers; empty: every span kept
        out: list[OpResult] = []
        if not any(span.producer_id for span in op.spans):
            # No idempotent producer: every span is stored, in order; the
            # answers are written as bytes at once (node_daemon.state.responses).
            if results:
                out = [
                    OpResult(response=r)
                    for r in publish_responses(partitions, nxt, counts, index, self.group)
                ]
            nxt = [base + part.count for base, part in zip(nxt, op.parts, strict=True)]
        else:
            nxt = self._producer_spans(
                txn, op, tid, partitions, counts, nxt, index, results, kept, out
            )
        every = all(kept)
        self.heat.record(
            txn,
            tid,
            {s.client_id for s in op.spans}
            if every
            else {s.client_id for s, k in zip(op.spans, kept, strict=True) if k},
            leader_ms,
        )
        for i, part in enumerate(op.parts):
            st = states[i]
            count = nxt[i] - st.next_offset
            if not count:
                continue
            batch = part.batch
            if not every:
                batch = _kept_rows(batch, [row[i] for row in counts], kept)
            p, base = part.partition, st.next_offset
            append_ms = max(leader_ms, st.last_append_ms)  # monotonic per partition
            key = _BATCH.pack(tid, p, base)
            ref = _ref_to(at, i, batch, index) if every else None
            if ref is not None:
                batch_store.put_ref(txn, self.batches, key, count, append_ms, ref)
            else:
                batch_store.put_batch(txn, self.batches, self._more, key, count, append_ms, batch)
            txn.put(_TIME.pack(tid, p, append_ms, base), b"", db=self.timeidx)
            txn.put(
                _PART.pack(tid, p),
                _PART_VAL.pack(st.first_offset, base + count, append_ms),
                db=self.parts,
            )
            self._states[tid, p] = PartitionState(st.first_offset, base + count, append_ms)
        return out if results else []

    def _producer_spans(
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
                    self._refusal(txn, pid, span.client_id, epoch=epoch)
                    if self.issues_producers
                    else None
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
                            _PROD.pack(pid, tid, p), _seq_record(epoch, recent), db=self.producers
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

    def _next_epoch(self, txn: Any, pid: int, client_id: str) -> bytes:
        """Keep issued producer id ``pid`` for ``client_id`` under its next
        epoch: the InitProducerResponse. Counts as a use: its lifetime starts
        again (``expirable_producers``)."""
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
        txn.put(_issued_at_key(pid), _U64.pack(max(self._log_ms, 0)), db=self.meta)
        txn.put(_by_age_key(self._log_ms, pid), b"", db=self.meta)
        return client_pb2.InitProducerResponse(producer_id=pid, epoch=epoch).SerializeToString()

    def _epoch_in(self, txn: Any, pid: int) -> int:
        """Producer id ``pid``'s current epoch as ``txn`` says (0: never renewed)."""
        raw = txn.get(_epoch_key(pid), db=self.meta)
        return int(_EPOCH.unpack(raw)[0]) if raw else 0

    def _refusal(
        self, txn: Any, pid: int, client_id: str, cached: bool = True, epoch: int = 0
    ) -> tuple[Code, str] | None:
        """Why ``client_id`` may not append with producer id ``pid`` under
        ``epoch`` (None: it may). ``cached`` False: read from ``txn`` alone,
        leaving the applying thread's caches alone (for a reader on another
        thread)."""
        # An owner is read (and, cached, remembered) only once the id is issued.
        if cached:
            issued = self.producer_issued(txn, pid)
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

    def producer_refusal(self, pid: int, client_id: str, epoch: int = 0) -> tuple[Code, str] | None:
        """``_refusal`` as of what this replica applied (a data group's
        leader asks group 0's before proposing)."""
        with self.env.begin() as txn:
            return self._refusal(txn, pid, client_id, cached=False, epoch=epoch)

    def producer_issued(self, txn: Any, pid: int) -> bool:
        """Whether producer id ``pid`` was issued by InitProducer: one of the
        counter's (entries from before random ids) or a registered one."""
        if pid in self._issued:
            return True
        if self._issued_in(txn, pid):
            self._issued.add(pid)
            return True
        return False

    def _issued_in(self, txn: Any, pid: int) -> bool:
        """``producer_issued`` as ``txn`` says, without the cache."""
        return pid <= self._meta_int(txn, b"next_producer_id") or bool(
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

    def _state(self, txn: Any, tid: int, p: int) -> PartitionState:
        """``_part_state`` for appends: remembered between them."""
        st = self._states.get((tid, p))
        if st is None:
            st = self._states[tid, p] = self._part_state(txn, tid, p)
        return st

    def _sequences(self, txn: Any, pid: int, tid: int, p: int) -> tuple[int, list[_Seq]]:
        """Producer ``pid``'s record in a partition: its epoch and latest sequences."""
        raw = txn.get(_PROD.pack(pid, tid, p), db=self.producers)
        return _parse_seq_record(raw) if raw else (0, [])

    # ------------------------------------------------------------ retention

    def _trim(self, txn: Any, leader_ms: int) -> None:
        for _, raw in txn.cursor(db=self.topics):
            topic = topics_pb2.Topic.FromString(raw)
            cutoff = leader_ms - topic.spec.retention_ms
            for p in range(topic.spec.partitions):
                self._trim_partition(txn, topic.id, p, cutoff)

    def _trim_heatmaps(self, txn: Any, log_ms: int, keep_newest: int) -> None:
        """Heat maps whose window ended before the log's clock minus their
        topic's retention go, but each topic's newest ``keep_newest`` stay
        (``HeatmapTables.trim``). On the log's clock, which never goes back,
        so a later trim drops at least what an earlier one did."""
        for _, raw in txn.cursor(db=self.topics):
            topic = topics_pb2.Topic.FromString(raw)
            self.heat.trim(txn, topic.id, log_ms - topic.spec.retention_ms, keep_newest)

    def _expire_records(self, txn: Any, log_ms: int) -> None:
        """Per-client records retention has made useless: contributions
        older than their topic's retention, and producer records of a
        partition none of whose batches is stored any more (a retry of
        those could only be of pings retention deleted)."""
        firsts: dict[tuple[int, int], int] = {}
        for _, raw in txn.cursor(db=self.topics):
            topic = topics_pb2.Topic.FromString(raw)
            self.heat.expire_contributions(txn, topic.id, log_ms - topic.spec.retention_ms)
            for p in range(topic.spec.partitions):
                firsts[topic.id, p] = self._part_state(txn, topic.id, p).first_offset
        doomed = []
        for key, raw in txn.cursor(db=self.producers):
            _, tid, p = _PROD.unpack(key)
            first = firsts.get((tid, p))
            ends = [base + count for _, base, count in _parse_seq_record(raw)[1]]
            if first is None or max(ends, default=0) <= first:
                doomed.append(bytes(key))
        for key in doomed:
            txn.delete(key, db=self.producers)

    def _has_records(self, txn: Any, pid: int) -> bool:
        cur = txn.cursor(db=self.producers)
        return bool(cur.set_range(_U64.pack(pid))) and cur.key()[:8] == _U64.pack(pid)

    def _forget_producer(self, txn: Any, pid: int) -> None:
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

    def expirable_producers(
        self, lifetime_ms: int = PRODUCER_ID_LIFETIME_MS, limit: int = EXPIRED_PRODUCERS_PER_TRIM
    ) -> list[int]:
        """For the leader's trim: producer ids issued more than
        ``lifetime_ms`` before the log's clock with no record left (at most
        ``limit``, the oldest first, looking at most at EXPIRY_SCAN_KEYS
        ids). A read: safe off the applying thread."""
        out: list[int] = []
        with self.env.begin() as txn:
            cutoff = self._meta_int(txn, b"log_ms") - lifetime_ms
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

    def producer_ids_held(self, client_id: str, limit: int = MAX_PRODUCER_IDS_PER_CLIENT) -> int:
        """How many producer ids are bound to ``client_id`` (counted up to
        ``limit``: the quota check needs no more)."""
        with self.env.begin() as txn:
            return count_prefix(txn, self.meta, _held_prefix(client_id), limit)

    def _trim_partition(self, txn: Any, tid: int, p: int, cutoff_ms: int) -> None:
        st = self._part_state(txn, tid, p)
        cur = txn.cursor(db=self.timeidx)
        first = st.first_offset
        if not cur.set_range(_TIME.pack(tid, p, 0, 0)):
            return
        doomed = []
        for key, _ in cur:
            t, q, append_ms, base = _TIME.unpack(key)
            if (t, q) != (tid, p) or append_ms >= cutoff_ms:
                break
            doomed.append((key, base))
        for key, base in doomed:
            raw = batch_store.delete_batch(txn, self.batches, self._more, _BATCH.pack(tid, p, base))
            if raw is not None:
                first = max(first, base + _BATCH_HDR.unpack_from(raw)[0])
                if batch_refs.is_ref(raw, _BATCH_HDR.size):
                    self.refs_released = True
            txn.delete(key, db=self.timeidx)
        if first != st.first_offset:
            txn.put(
                _PART.pack(tid, p),
                _PART_VAL.pack(first, st.next_offset, st.last_append_ms),
                db=self.parts,
            )

    # ---------------------------------------------------------------- reads

    def topic(self, name: str) -> topics_pb2.Topic:
        """The topic record alone (no partition states): for the write path."""
        with self.env.begin() as txn:
            return self._topic(txn, name)

    def describe(self, name: str) -> topics_pb2.TopicDescription:
        with self.env.begin() as txn:
            return self._describe(txn, self._topic(txn, name))

    def topic_records(self) -> dict[str, topics_pb2.Topic]:
        """Every topic's record by name (no partition states: cheap)."""
        with self.env.begin() as txn:
            return {
                k.decode(): topics_pb2.Topic.FromString(v) for k, v in txn.cursor(db=self.topics)
            }

    def list_topics(self) -> list[topics_pb2.TopicDescription]:
        with self.env.begin() as txn:
            return [
                self._describe(txn, topics_pb2.Topic.FromString(raw))
                for _, raw in txn.cursor(db=self.topics)
            ]

    def topics_page(
        self, after: str, limit: int, max_bytes: int
    ) -> tuple[list[topics_pb2.TopicDescription], str]:
        """Topics named after ``after``, in name order: at most ``limit``,
        and no more once ``max_bytes`` are reached (always one, if any is
        left). Returns them and the token of the next page ("": none)."""
        out: list[topics_pb2.TopicDescription] = []
        size = 0
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.topics)
            key = after.encode()
            if not cur.set_range(key):
                return out, ""
            for k, raw in cur:
                if k == key:
                    continue
                if len(out) >= limit or (out and size >= max_bytes):
                    return out, out[-1].topic.spec.name
                d = self._describe(txn, topics_pb2.Topic.FromString(raw))
                out.append(d)
                size += d.ByteSize()
        return out, ""

    def peers(self) -> dict[int, str]:
        """The replicated address book: node id -> gRPC address."""
        out: dict[int, str] = {}
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.meta)
            if cur.set_range(b"peer/"):
                for k, v in cur:
                    if not k.startswith(b"peer/"):
                        break
                    out[_PEER.unpack(k)[1]] = bytes(v).decode()
        return out

    def replace_address_book(self, addresses: dict[int, str]) -> None:
        """Make the address book exactly `addresses` (restore only: outside
        the log, the same on every node restored with the same voters)."""
        with self.env.begin(write=True) as txn:
            for node_id in list(self.peers()):
                txn.delete(_PEER.pack(b"peer/", node_id), db=self.meta)
            for node_id, address in sorted(addresses.items()):
                txn.put(_PEER.pack(b"peer/", node_id), address.encode(), db=self.meta)
        self.env.sync(True)

    def identity(self, token_hash: bytes) -> clients_pb2.ClientIdentity | None:
        """Whose token has this SHA-256 (None: nobody's, or revoked)."""
        with self.env.begin() as txn:
            return self.clients.by_hash(txn, token_hash)

    def list_clients(self) -> clients_pb2.ListClientsResponse:
        with self.env.begin() as txn:
            return self.clients.listing(txn)

    def describe_group(self, name: str) -> groups_pb2.GroupDescription:
        with self.env.begin() as txn:
            return self.consumer_groups.describe(txn, name)

    def list_groups(self) -> list[groups_pb2.GroupDescription]:
        with self.env.begin() as txn:
            return [self.consumer_groups.describe(txn, n) for n in self.consumer_groups.names(txn)]

    def group_records(self) -> list[groups_pb2.Group]:
        """Every consumer group without its offsets (the leader's scan)."""
        with self.env.begin() as txn:
            return self.consumer_groups.records(txn)

    def group_join_refusal(self, op: command_pb2.JoinGroupOp) -> RoadlogError | None:
        """Why the join would pass a group quota (the leader asks first)."""
        with self.env.begin() as txn:
            return self.consumer_groups.quota_refusal(txn, op)

    def monitoring_figures(self) -> tuple[list[TopicFigures], list[GroupFigures]]:
        """Per topic and per consumer group, what a node exports for
        monitoring, from one read transaction (safe beside the applier)."""
        topics: dict[str, tuple[topics_pb2.Topic, list[PartitionState]]] = {}
        out_topics: list[TopicFigures] = []
        out_groups: list[GroupFigures] = []
        with self.env.begin() as txn:
            for _, raw in txn.cursor(db=self.topics):
                topic = topics_pb2.Topic.FromString(raw)
                states = [self._part_state(txn, topic.id, p) for p in range(topic.spec.partitions)]
                topics[topic.spec.name] = (topic, states)
                windows = self.heat.windows(txn, topic.id)
                hm = self.heat.get(txn, topic.id, windows[-1]) if windows else None
                out_topics.append(
                    TopicFigures(
                        name=topic.spec.name,
                        appended=sum(st.next_offset for st in states),
                        kept=sum(st.next_offset - st.first_offset for st in states),
                        heatmap_computed_ms=hm.computed_ms if hm else 0,
                        heatmap_window_end_ms=hm.window_end_ms if hm else 0,
                    )
                )
            for name in self.consumer_groups.names(txn):
                d = self.consumer_groups.describe(txn, name)
                if d.group.topic not in topics:
                    continue
                committed = {o.partition: o.offset for o in d.offsets}
                states = topics[d.group.topic][1]
                lag = sum(
                    max(0, st.next_offset - max(committed.get(p, 0), st.first_offset))
                    for p, st in enumerate(states)
                )
                out_groups.append(GroupFigures(name=name, topic=d.group.topic, lag=lag))
        return out_topics, out_groups

    def heatmap(
        self, req: client_pb2.GetHeatmapRequest, now_ms: int, elsewhere: int | None = None
    ) -> client_pb2.GetHeatmapResponse:
        """A heat map for a contributor: the give-to-get rule first, then the
        map (the latest window unless one is asked for). ``elsewhere``: the
        client's last contribution in the topic's data groups."""
        with self.env.begin() as txn:
            topic = self._topic(txn, req.topic)
            last = self.heat.allowed(txn, topic, req.client_id, now_ms, elsewhere)
            windows = self.heat.windows(txn, topic.id, req.max_windows)
            start = req.window_start_ms or (windows[-1] if windows else 0)
            hm = self.heat.get(txn, topic.id, start) if windows else None
            if hm is None:
                what = f"window {req.window_start_ms}" if req.window_start_ms else "any window"
                raise RoadlogError(
                    Code.NOT_FOUND,
                    f"no heat map of {req.topic!r} for {what} yet (the Spark job writes them)",
                )
            return client_pb2.GetHeatmapResponse(heatmap=hm, contributed_ms=last, windows=windows)

    def last_contribution(self, name: str, client_id: str) -> int | None:
        """When ``client_id`` last published to topic ``name`` here (None:
        not lately, or no such topic here)."""
        with self.env.begin() as txn:
            raw = txn.get(name.encode(), db=self.topics)
            if raw is None:
                return None
            tid = topics_pb2.Topic.FromString(raw).id
            return self.heat.last_contribution(txn, tid, client_id)

    def read_range(
        self, name: str, partition: int, start: int, end: int, max_pings: int = 200_000
    ) -> tuple[list[client_pb2.StoredBatchView], int]:
        """Batches covering offsets [start, end) from ``start`` on, cut to
        exactly that range, up to about ``max_pings``; and the offset to go on
        from (``end`` when done). Offsets trimmed by retention are skipped."""
        req = client_pb2.FetchRequest(
            topic=name, partition=partition, offset=start, max_pings=max_pings
        )
        resp, counts = self._fetch(req)
        out: list[client_pb2.StoredBatchView] = []
        nxt = max(start, resp.first_offset)
        for b, count in zip(resp.batches, counts, strict=True):
            if b.base_offset >= end:
                break
            if b.base_offset + count > end:  # cut the last batch at the range's end
                cols = columnar.decode(b.batch)
                cols = cols.take(np.arange(end - b.base_offset))
                b.batch = columnar.encode(cols)
                count = end - b.base_offset
            out.append(b)
            nxt = b.base_offset + count
        if not out or nxt >= resp.end_offset:
            nxt = end
        return out, min(nxt, end)

    def fetch(
        self, req: client_pb2.FetchRequest, max_default: int = 10_000
    ) -> client_pb2.FetchResponseView:
        """Pings of one partition from ``req.offset`` on, whole batches up to
        ``max_pings`` (the first batch cut to start exactly at the offset).
        Each batch is the PingBatch bytes as stored (only a cut one is
        encoded anew)."""
        return self._fetch(req, max_default)[0]

    def _fetch(
        self, req: client_pb2.FetchRequest, max_default: int = 10_000
    ) -> tuple[client_pb2.FetchResponseView, list[int]]:
        """``fetch``, and the number of pings of each batch."""
        limit = req.max_pings or max_default
        counts: list[int] = []
        self._open_pieces()
        with self.env.begin() as txn:
            topic = self._topic(txn, req.topic)
            if req.partition >= topic.spec.partitions:
                raise RoadlogError(Code.INVALID_ARGUMENT, f"no partition {req.partition}")
            tid, p = topic.id, req.partition
            st = self._part_state(txn, tid, p)
            resp = client_pb2.FetchResponseView(
                end_offset=st.next_offset, first_offset=st.first_offset
            )
            offset = max(req.offset, st.first_offset)
            if req.offset > st.next_offset:
                raise RoadlogError(
                    Code.OUT_OF_RANGE,
                    f"offset {req.offset} is beyond the end {st.next_offset}",
                )
            total = 0
            for base, append_ms, count, batch in self._batches_from(txn, tid, p, offset):
                if total and total + count > limit:
                    break
                sb = resp.batches.add(append_ms=append_ms)
                if base < offset:  # the first batch starts before the offset: cut it
                    cols = columnar.decode(batch)
                    skip = offset - base
                    cols = cols.take(np.arange(skip, count))
                    sb.base_offset, count = offset, count - skip
                    sb.batch = columnar.encode(cols)
                else:
                    sb.base_offset = base
                    sb.batch = batch
                counts.append(count)
                total += count
                offset = sb.base_offset + count
                if total >= limit:
                    break
            resp.next_offset = offset
            return resp, counts

    def _batches_from(
        self, txn: Any, tid: int, p: int, offset: int
    ) -> Iterator[tuple[int, int, int, bytes]]:
        """(base, append ms, count, PingBatch bytes) of the partition's
        batches from the one holding ``offset`` on."""
        prefix = _PART.pack(tid, p)
        start = _BATCH.pack(tid, p, offset)
        cur = txn.cursor(db=self.batches)
        found = cur.set_range(start)
        if not found or cur.key() != start:
            # The batch holding ``offset`` starts before it: step back one.
            moved = cur.prev() if found else cur.last()
            if (not moved or not cur.key().startswith(prefix)) and not cur.set_range(start):
                return
        for key, value in cur:
            if not key.startswith(prefix):
                return
            base = _BATCH.unpack(key)[2]
            count, append_ms = _BATCH_HDR.unpack_from(value)
            if base + count <= offset:
                continue
            try:
                data = batch_store.batch_bytes(txn, self._more, key, value, self.entries)
            except batch_store.PiecesNotOpen:
                raise RoadlogError(
                    Code.UNAVAILABLE, "this replica's batches are not readable yet: try again"
                ) from None
            except MissingEntryError as e:
                # Retention released it while this read was under way (or
                # the log was replaced by a snapshot): read again.
                raise RoadlogError(
                    Code.UNAVAILABLE, f"a batch's log entry is no longer here ({e}): try again"
                ) from None
            yield base, append_ms, count, data

    def offsets_for_window(
        self, name: str, partition: int, start_ms: int, end_ms: int
    ) -> tuple[int, int]:
        """[first offset, end offset) of the batches appended in [start, end)."""
        with self.env.begin() as txn:
            topic = self._topic(txn, name)
            tid = topic.id
            st = self._part_state(txn, tid, partition)

            def first_at(ms: int) -> int:
                cur = txn.cursor(db=self.timeidx)
                if cur.set_range(_TIME.pack(tid, partition, max(ms, 0), 0)):
                    t, q, _, base = _TIME.unpack(cur.key())
                    if (t, q) == (tid, partition):
                        return int(base)
                return st.next_offset

            return first_at(start_ms), first_at(end_ms)

    # ----------------------------------------------------------- durability

    def oldest_entry_ref(self) -> int | None:
        """The lowest log index a stored batch refers to (None: none does):
        the log must keep every entry from there on."""
        with self.env.begin() as txn:
            return _oldest_ref(txn, self.parts, self.batches)

    def size_bytes(self) -> int:
        """The high-water mark of the state's LMDB pages: about what a
        snapshot copies."""
        return int((self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"])

    def checkpoint(self) -> None:
        """fsync: what is applied now survives a crash."""
        self.env.sync(True)

    def digest(self) -> bytes:
        """SHA-256 over every stored key and value, database by database."""
        return self.indexed_digest()[1]

    def stored_applied_index(self) -> int:
        """The applied index as last committed (by whichever process applies)."""
        with self.env.begin() as txn:
            return self._meta_int(txn, b"applied_index")

    def indexed_digest(self) -> tuple[int, bytes]:
        """(applied index, ``digest``) as one read transaction sees them.
        Safe while another thread applies: the index is the one the digest
        is of, never a later one (``self.applied_index`` read after the
        digest could be: an entry applied meanwhile on the event loop)."""
        h = hashlib.sha256()
        self._open_pieces()
        with self.env.begin() as txn:
            index = self._meta_int(txn, b"applied_index")
            for name, db in (
                (b"topics", self.topics),
                (b"parts", self.parts),
                (b"batches", self.batches),
                (b"timeidx", self.timeidx),
                (b"producers", self.producers),
                (b"meta", self.meta),
                (b"groups", self.consumer_groups.groups),
                (b"offsets", self.consumer_groups.offsets),
                (b"contrib", self.heat.contrib),
                (b"heatmaps", self.heat.heatmaps),
                (b"clients", self.clients.clients),
            ):
                h.update(name)
                for k, v in txn.cursor(db=db):
                    if db is self.batches:  # the batch whole, however it lies
                        v = batch_store.whole_value(txn, self._more, k, v, self.entries)
                    elif db is self.meta and k == _FORMAT_KEY:
                        continue
                    h.update(struct.pack(">II", len(k), len(v)))
                    h.update(k)
                    h.update(v)
        return index, h.digest()

    def write_snapshot(
        self,
        dest: str | os.PathLike[str],
        rate: float | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[int, int]:
        """A copy of the state as one read transaction sees it, as one file
        ``dest`` (fsynced). Returns the (applied index, applied term) of that
        copy, read from the copy itself. Safe while another thread applies:
        the copy is consistent at whatever index its transaction began.

        A page copy, not a compacting one: LMDB writes the used pages as they
        lie (free pages included) with about a hundredth of the CPU of
        rewriting the tree (measured: 0.015 against 1.7 CPU-seconds for
        519 MB), and snapshots are taken every few hundred MiB of log. With
        a ``rate`` it reaches the disk a little at a time, at most ``rate``
        bytes a second (``paced_copy``), not in one burst that the log's
        fsyncs wait behind; without, LMDB copies it as fast as the disk
        takes it. Setting ``cancel`` gives a paced copy up (CopyCancelled),
        leaving nothing behind."""
        tmp = Path(f"{dest}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        data = tmp / "data.mdb"
        try:
            if rate is None:
                self.env.copy(str(tmp))  # LMDB's own, at once
                with open(data, "rb+") as f:
                    os.fsync(f.fileno())
            else:
                copy_paced(self.env, data, rate, cancel=cancel)  # fsynced
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        index, term = applied_of(tmp)
        os.replace(data, dest)
        shutil.rmtree(tmp, ignore_errors=True)
        return index, term

    def install_snapshot(self, snapshot_file: str | os.PathLike[str]) -> None:
        """Replace the whole state with a snapshot file, atomically: a crash
        leaves either the old state or the new one."""
        staging = Path(f"{self.path}.incoming")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
            # A snapshot that carries log entries (kept_log: the raft log
            # took them) is installed without them.
            if not kept_log.copy_state_without_kept(Path(snapshot_file), staging):
                shutil.copyfile(snapshot_file, staging / "data.mdb")
            with open(staging / "data.mdb", "rb+") as f:
                os.fsync(f.fileno())
            fsync_dir(staging)
            _check_format(staging)  # a newer release's state: refused, the old one kept
        except (OSError, lmdb.Error) as e:
            # No room for the copy (finding 13): nothing changed; the caller
            # tries again later, or the node says it cannot start.
            shutil.rmtree(staging, ignore_errors=True)
            if full_disk_error(e, self.path.parent):
                why = f"disk full installing a snapshot in {self.path}: {e}"
                raise StorageFullError(why) from e
            raise
        except StateFormatError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.env.close()
        old = Path(f"{self.path}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(self.path, old)
        os.replace(staging, self.path)
        # Durable before anything is applied on top (a power loss must not
        # bring the old state back under a log compacted past it).
        fsync_dir(self.path.parent)
        shutil.rmtree(old, ignore_errors=True)
        self._open()


def _stored_meta(directory: str | os.PathLike[str], keys: Sequence[bytes]) -> list[int] | None:
    """The integers under ``keys`` in the ``meta`` of the state environment
    in ``directory`` (0 where absent), opened read-only and without a lock
    file; None if it has no ``meta`` (nothing was ever applied)."""
    env = lmdb.open(str(directory), readonly=True, lock=False, max_dbs=16)
    try:
        try:
            meta = env.open_db(b"meta", create=False)
        except lmdb.NotFoundError:
            return None
        with env.begin() as txn:
            values = [txn.get(k, db=meta) for k in keys]
    finally:
        env.close()
    return [int(_U64.unpack(v)[0]) if v else 0 for v in values]


def _refuse_newer(directory: Path, stored: int) -> None:
    """StateFormatError if ``stored`` is a format this release cannot read."""
    if stored > STATE_FORMAT:
        raise StateFormatError(
            f"the state in {directory} has format {stored}, written by a newer release of "
            f"roadlog; this one reads formats up to {STATE_FORMAT}"
        )


def _check_format(directory: Path) -> None:
    """StateFormatError if the state environment in ``directory`` has a
    format this release cannot read (one with nothing applied: any reads it)."""
    stored = _stored_meta(directory, [_FORMAT_KEY])
    if stored is not None:
        _refuse_newer(directory, stored[0])


def applied_of(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """The (applied index, applied term) recorded in a state environment's
    copy, opened read-only and without a lock file."""
    values = _stored_meta(directory, [b"applied_index", b"applied_term"])
    if values is None:
        raise lmdb.NotFoundError(f"no meta database in the state in {directory}")
    index, term = values
    return index, term


def normalized_spec(spec: topics_pb2.TopicSpec) -> topics_pb2.TopicSpec:
    """Defaults filled in and everything checked; RoadlogError when invalid."""
    try:
        check_topic_name(spec.name)
        region = parse_region(spec.region_geojson)
    except (ValueError, RegionError) as e:
        raise RoadlogError(Code.INVALID_ARGUMENT, str(e)) from None
    out = topics_pb2.TopicSpec(
        name=spec.name,
        region_geojson=region.geojson,
        partitions=spec.partitions or DEFAULT_PARTITIONS,
        retention_ms=spec.retention_ms or DEFAULT_RETENTION_MS,
        h3_resolution=spec.h3_resolution or DEFAULT_H3_RESOLUTION,
        contribution_window_ms=spec.contribution_window_ms or DEFAULT_CONTRIBUTION_WINDOW_MS,
    )
    if out.contribution_window_ms < 0:
        raise RoadlogError(Code.INVALID_ARGUMENT, "the contribution window must be positive")
    if not 1 <= out.partitions <= MAX_PARTITIONS:
        raise RoadlogError(Code.INVALID_ARGUMENT, f"partitions must be in 1..{MAX_PARTITIONS}")
    if out.retention_ms < 0:
        raise RoadlogError(Code.INVALID_ARGUMENT, "retention must be positive")
    if out.h3_resolution > 15:
        raise RoadlogError(Code.INVALID_ARGUMENT, "H3 resolution must be in 0..15")
    return out


def _delete_prefix(txn: Any, db: Any, prefix: bytes) -> None:
    cur = txn.cursor(db=db)
    if not cur.set_range(prefix):
        return
    while cur.key().startswith(prefix):
        if not cur.delete():
            break


def _check_topic_id(op: command_pb2.AppendOp, topic: topics_pb2.Topic) -> None:
    """Refuse an op made for another topic of the same name (a data group's
    part, made for the topic group 0 holds now)."""
    if op.topic_id and op.topic_id != topic.id:
        raise RoadlogError(
            Code.UNAVAILABLE,
            f"topic {op.topic!r} here is not the one group 0 holds now: try again",
        )


def _check_layout(op: command_pb2.AppendOp, counts: list[list[int]], nparts: int) -> None:
    """Refuse (on every replica alike) an op whose parts and spans disagree;
    ``counts`` are the spans' counts."""
    if not counts:
        raise RoadlogError(Code.INVALID_ARGUMENT, "an append without spans")
    width = len(op.parts)
    for row in counts:
        if len(row) != width:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a span without a count per part")
        if not any(row):
            raise RoadlogError(Code.INVALID_ARGUMENT, "an empty span")
    sums = [sum(column) for column in zip(*counts, strict=True)] if width else []
    seen = set()
    for part, total in zip(op.parts, sums, strict=True):
        if part.partition >= nparts:
            raise RoadlogError(Code.INVALID_ARGUMENT, f"no partition {part.partition}")
        if part.partition in seen:
            raise RoadlogError(Code.INVALID_ARGUMENT, f"partition {part.partition} twice")
        seen.add(part.partition)
        if part.count == 0 or part.count != total:
            raise RoadlogError(Code.INVALID_ARGUMENT, "part counts disagree with spans")


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


def _oldest_ref(txn: Any, parts: Any, batches: Any) -> int | None:
    """The lowest log index a batch in ``batches`` refers to, None if none
    does. Batches lie in offset order within a partition, and so in log
    order: each partition's first reference is its lowest."""
    lowest: int | None = None
    cur = txn.cursor(db=batches)
    for key in txn.cursor(db=parts).iternext(values=False):
        if not cur.set_range(key):
            break
        for k, v in cur:
            if not k.startswith(key):
                break
            if batch_refs.is_ref(v, _BATCH_HDR.size):
                index = batch_refs.decode_ref(v, _BATCH_HDR.size)[0]
                lowest = index if lowest is None else min(lowest, index)
                break
    return lowest


def oldest_ref_in_snapshot(snapshot_file: str | os.PathLike[str]) -> int | None:
    """``StateMachine.oldest_entry_ref`` of a state snapshot file."""
    env = kept_log.open_snapshot_file(snapshot_file)
    try:
        try:
            parts, batches = (
                env.open_db(b"parts", create=False),
                env.open_db(b"batches", create=False),
            )
        except lmdb.NotFoundError:
            return None
        with env.begin() as txn:
            return _oldest_ref(txn, parts, batches)
    finally:
        env.close()


def _ref_to(
    at: tuple[bytes, list[tuple[int, int]]] | None, part: int, batch: bytes, index: int
) -> bytes | None:
    """A reference to part ``part``'s batch in entry ``index``'s data, if
    ``at`` says where it lies and those bytes are the batch; else None."""
    if at is None:
        return None
    data, spans = at
    if part >= len(spans):
        return None
    offset, length = spans[part]
    if length != len(batch) or not length or not data.startswith(batch, offset):
        return None
    return batch_refs.encode_ref(index, offset, length)


def _kept_rows(batch: bytes, counts: list[int], kept: list[bool]) -> bytes:
    """The batch without the rows of spans not kept (spans are consecutive)."""
    cols = columnar.decode(batch)
    mask = np.repeat(np.array(kept, dtype=bool), counts)
    return columnar.encode(cols.take(np.flatnonzero(mask)))


def trim_op(
    heatmap_keep_newest: int = HEATMAP_KEEP_NEWEST,
    expired_producers: Sequence[int] = (),
    expire_records: bool = True,
    group_retention_ms: int = GROUP_RETENTION_MS,
) -> command_pb2.Op:
    """The retention op a leader proposes every ``trim_interval_s``: pings,
    heat maps (all but the newest ``heatmap_keep_newest`` windows of a
    topic) and per-client records older than the topic's retention, the
    producer ids ``expirable_producers`` found, and consumer groups empty
    for longer than ``group_retention_ms``."""
    return command_pb2.Op(
        trim=command_pb2.TrimOp(
            heatmap_keep_newest=heatmap_keep_newest,
            expire_records=expire_records,
            expired_producers=expired_producers,
            group_retention_ms=group_retention_ms,
        )
    )


def append_op(
    topic: str,
    parts: Sequence[tuple[int, PingColumns]],
    producer_id: int = 0,
    sequence: int = 0,
    client_id: str = "",
) -> command_pb2.Op:
    """The operation appending one request's batch, already split by partition."""
    op = command_pb2.AppendOp(topic=topic)
    span = op.spans.add(client_id=client_id, producer_id=producer_id, sequence=sequence)
    for p, cols in parts:
        op.parts.add(partition=p, batch=columnar.encode(cols), count=len(cols))
        span.counts.append(len(cols))
    return command_pb2.Op(append=op)
