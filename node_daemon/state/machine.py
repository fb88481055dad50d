"""The replicated state machine on LMDB: it applies committed Raft entries
to its tables, answers reads from them, and copies itself into snapshots.

Committed Raft entries are applied in one write transaction per call, which
also records the applied index and term, so after a crash the state is
exactly that of some applied index (and re-applying from the log is never
needed for a partial entry). The environment is opened without fsync on
commit: ``checkpoint()`` makes it durable, and must be called before the
Raft log is compacted past what is durable here.

Named databases (keys big-endian, so LMDB orders them numerically), each
with the module of its concern:

- ``topics``, ``parts``: topics and their partitions' states (``topics``)
- ``batches``, ``batchmore``, ``timeidx``: the partitions' pings (``pings``)
- ``producers``: producers' recent sequences per partition (``producers``)
- ``groups``, ``offsets``: consumer groups (``consumer_groups``)
- ``contrib``, ``heatmaps``: contributions and heat maps (``heatmaps``)
- ``clients``: client identities and their tokens' hashes (``clients``)
- ``meta``: applied index/term, id counters, producer ids, the address
  book, the log's clock (``log_ms``), the state's format (``format``) and
  the cluster settings set (``settings``)

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from node_daemon.raft import Entry, EntryType, StorageFullError
from node_daemon.state import batch_refs, batch_store
from node_daemon.state.batch_refs import EntrySource
from node_daemon.state.clients import ClientTables
from node_daemon.state.consumer_groups import GROUP_RETENTION_MS, ConsumerGroupTables
from node_daemon.state.federation import OPS as FEDERATION_OPS
from node_daemon.state.federation import FederationTable
from node_daemon.state.figures import ConsumerGroupFigures as ConsumerGroupFigures
from node_daemon.state.figures import TopicFigures as TopicFigures
from node_daemon.state.figures import monitoring_figures
from node_daemon.state.format import (
    FORMAT_KEY,
    STATE_FORMAT,
    StateFormatError,
    applied_of,
    check_format,
    refuse_newer,
)
from node_daemon.state.heatmaps import (
    DEFAULT_CONTRIBUTION_WINDOW_MS,
    HEATMAP_KEEP_NEWEST,
    Contribution,
    HeatmapTables,
)
from node_daemon.state.keys import delete_prefix, meta_int
from node_daemon.state.paced_copy import copy_paced
from node_daemon.state.pings import PingTables, check_layout, kept_rows, oldest_ref, ref_to
from node_daemon.state.producers import (
    EXPIRED_PRODUCERS_PER_TRIM,
    MAX_PRODUCER_IDS_PER_CLIENT,
    PRODUCER_ID_LIFETIME_MS,
    ProducerTables,
)
from node_daemon.state.responses import OpResult, publish_responses
from node_daemon.state.settings import REGISTRATION_IDLE_DAYS, SettingsTable
from node_daemon.state.topic_moves import OPS as MOVE_OPS
from node_daemon.state.topic_moves import TopicMoves
from node_daemon.state.topics import PartitionState, TopicTables, check_topic_id
from node_daemon.storage import kept_log
from node_daemon.storage.disk import fsync_dir, full_disk_error, open_lmdb
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import (
    client_pb2,
    clients_pb2,
    command_pb2,
    federation_pb2,
    groups_pb2,
    settings_pb2,
    topics_pb2,
)

GiB = 1 << 30
T = TypeVar("T")

_U64 = struct.Struct(">Q")

_PEER = struct.Struct(">5sQ")  # b"peer/" + node id: the replicated address book
# Operations that write topic records or partition states other than by appending.
_FORGETTING = frozenset(
    {"create_topic", "delete_topic", "trim", "place_topic", "update_topic", *MOVE_OPS}
)


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
        self._entries = entries
        # Set when retention or a topic's deletion removed batches stored as
        # references: the log may let their entries go at its next
        # compaction, which is then due (``Snapshots``); cleared by it.
        self.refs_released = False
        # Moved by every apply and by every _forget (a snapshot installed, a
        # failed transaction): answers told at one generation hold at it.
        self.generation = 0
        self.forgotten = 0  # idle identities this process's applies forgot (a metric)
        self._open()

    def _open(self) -> None:
        """Open the environment and its tables; a disk too full for the
        tables' first commit (creating one commits) is StorageFullError,
        which the node reports as "cannot start: the disk is full"."""
        try:
            self._open_tables()
        except lmdb.Error as e:
            if isinstance(e, lmdb.DiskError) or full_disk_error(e, self.path):
                with contextlib.suppress(Exception):
                    self.env.close()
                raise StorageFullError(f"disk full opening the state in {self.path}: {e}") from e
            raise

    def _open_tables(self) -> None:
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

        topics, parts, batches = db(b"topics"), db(b"parts"), db(b"batches")
        more = self._pieces()
        timeidx, producers, self.meta = db(b"timeidx"), db(b"producers"), db(b"meta")
        self.topics = TopicTables(topics, parts, self.meta)
        self.pings = PingTables(batches, more, timeidx, self.topics, self._entries)
        self.producers = ProducerTables(producers, self.meta, self.issues_producers, self.group)
        self.consumer_groups = ConsumerGroupTables(db(b"groups"), db(b"offsets"), self.meta)
        self.heat = HeatmapTables(db(b"contrib"), db(b"heatmaps"))
        self.clients = ClientTables(db(b"clients"), self.meta)
        self.settings = SettingsTable(self.meta)
        self.federation = FederationTable(self.meta)  # a directory's (issue 43)
        self.moves = TopicMoves(  # a member's topic moves (issue 43)
            self.topics, self.pings, self.producers, self.consumer_groups, self.heat, self.clients
        )
        with self.env.begin() as txn:
            stored_format = self._meta_int(txn, FORMAT_KEY)
            self.applied_index = self._meta_int(txn, b"applied_index")
            self.applied_term = self._meta_int(txn, b"applied_term")
            self.log_ms = self._meta_int(txn, b"log_ms")  # 0: nothing applied yet
        try:
            refuse_newer(self.path, stored_format)
        except StateFormatError:
            self.env.close()
            raise
        if not self.readonly and stored_format < STATE_FORMAT:
            with self.env.begin(write=True) as txn:
                txn.put(FORMAT_KEY, _U64.pack(STATE_FORMAT), db=self.meta)
        self._log_ms = self.log_ms  # while an apply's transaction is open
        self._forget()

    @property
    def entries(self) -> EntrySource | None:
        """The node's Raft log for this group, where batches stored as
        references lie (None: a state opened alone)."""
        return self._entries

    @entries.setter
    def entries(self, source: EntrySource | None) -> None:
        self._entries = self.pings.entries = source

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
        self.producers.forget_cached()  # which ids are issued, and to whom
        # The cluster's data groups once recorded (it never changes after: the
        # write path asks on every call); 0: not recorded yet.
        self._groups_recorded = 0

    def _open_pieces(self) -> None:
        """Open ``batchmore`` (creating it unless read-only). A read-only
        view of a replica whose writer has not created it yet tries again
        before each read transaction: a transaction can only use databases
        opened before it began (``batch_store.PiecesNotOpen``)."""
        if self.pings.more is None:
            self.pings.more = self._pieces()

    def _pieces(self) -> Any:
        """``batchmore``, None while a read-only view cannot open it yet."""
        with contextlib.suppress(lmdb.NotFoundError):  # read-only, not there yet
            return self.env.open_db(batch_store.MORE_NAME, create=not self.readonly)
        return None

    def _meta_int(self, txn: Any, key: bytes) -> int:
        return meta_int(txn, self.meta, key)

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
        check_topic_id(op, topic)
        tid = topic.id
        counts = [list(span.counts) for span in op.spans]
        check_layout(op, counts, topic.spec.partitions)
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
            desc = self.topics.create(
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
            self.topics.place(txn, op.place_topic.topic)
            return b""
        if kind == "update_topic":
            desc = self.topics.update(txn, op.update_topic.request)
            desc.applied_index = index
            return desc.SerializeToString()
        if kind in FEDERATION_OPS:
            return self.federation.apply(txn, op, self._log_ms, index)
        if kind == "fence_topic":
            return self.moves.fence(txn, op.fence_topic.request, index)
        if kind == "import_topic":
            return self.moves.import_topic(txn, op.import_topic.request, self._log_ms, index)
        if kind == "set_setting":
            key, value = op.set_setting.request.key, op.set_setting.request.value
            setting = self.settings.put(txn, key, value)
            return settings_pb2.SetSettingResponse(
                setting=setting, applied_index=index
            ).SerializeToString()
        if kind == "init_producer":
            return self.producers.init(txn, op.init_producer, self._log_ms)
        if kind == "trim":
            self._trim(txn, leader_ms)
            if op.trim.heatmap_keep_newest:  # 0: an entry from before heat-map retention
                self._trim_heatmaps(txn, self._log_ms, op.trim.heatmap_keep_newest)
            if op.trim.expire_records:  # false: an entry from before record expiry
                self._expire_records(txn, self._log_ms)
            for pid in op.trim.expired_producers:
                self.producers.drop(txn, pid)
            if op.trim.group_retention_ms:  # 0: an entry from before group expiry
                self.consumer_groups.expire(txn, self._log_ms - op.trim.group_retention_ms)
            if op.trim.forget_idle_clients:  # false: from before idle identities went
                idle = int(self.settings.value(txn, REGISTRATION_IDLE_DAYS))
                self.forgotten += self.clients.trim(txn, op.trim.clients_used, self._log_ms, idle)
            return b""
        if kind == "add_peer":
            ap = op.add_peer
            if not ap.node_id or not ap.address or len(ap.address) > 255:
                raise RoadlogError(Code.INVALID_ARGUMENT, "a peer needs an id and an address")
            txn.put(_PEER.pack(b"peer/", ap.node_id), ap.address.encode(), db=self.meta)
            return b""
        if kind == "join_group":
            req = op.join_group.request
            topic = self.topics.get(txn, req.topic)
            resp = self.consumer_groups.join(
                txn, req, topic.spec.partitions, leader_ms, index, op.join_group
            )
            return resp.SerializeToString()
        if kind == "leave_group":
            g = self.consumer_groups.get(txn, op.leave_group.group)
            nparts = self.topics.get(txn, g.topic).spec.partitions if g is not None else 0
            gen = self.consumer_groups.leave(
                txn, op.leave_group.group, list(op.leave_group.member_ids), nparts, self._log_ms
            )
            return client_pb2.LeaveGroupResponse(generation=gen).SerializeToString()
        if kind == "commit_offsets":
            commit = op.commit_offsets.request
            g = self.consumer_groups.get(txn, commit.group)
            if g is None:
                raise RoadlogError(Code.NOT_FOUND, f"no group {commit.group!r}")
            topic = self.topics.get(txn, g.topic)
            if topic.moving:  # federation (issue 43): fenced for a move
                raise RoadlogError(Code.UNAVAILABLE, f"topic {g.topic!r} is moving: try again")
            # A topic placed in data groups: its ends are theirs, which this
            # group's apply cannot read alike on every replica; its leader
            # checked the offsets against them before proposing.
            ends = (
                None
                if topic.partition_groups
                else {
                    o.partition: self.topics.part_state(txn, topic.id, o.partition).next_offset
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
                nparts = self.topics.get(txn, g.topic).spec.partitions
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
            topic = self.topics.get(txn, hm.topic)
            if topic.moving:  # federation (issue 43): fenced for a move
                raise RoadlogError(Code.UNAVAILABLE, f"topic {hm.topic!r} is moving: try again")
            self.heat.put(txn, topic, hm)
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

    def founded_data_groups(self) -> int | None:
        """The data groups the cluster was founded with, as its first topic
        recorded them (1 for a cluster whose topics came before groups);
        None before the first topic, when that is not decided yet."""
        with self.env.begin() as txn:
            return self.topics.founded_data_groups(txn)

    def data_groups(self) -> int:
        """The recorded number of data groups (1 before the first topic)."""
        if not self._groups_recorded:
            with self.env.begin() as txn:
                self._groups_recorded = self.topics.recorded_data_groups(txn)
        return self._groups_recorded or 1

    def _delete_topic(self, txn: Any, name: str) -> None:
        topic = self.topics.lookup(txn, name)
        if topic is None:
            raise RoadlogError(Code.NOT_FOUND, f"no topic {name!r}")
        prefix = struct.pack(">I", topic.id)
        if self.entries is not None:
            self.refs_released = True  # its log entries may go (if nothing else refers to them)
        for db in (self.topics.parts, self.pings.batches, self.pings.more, self.pings.timeidx):
            delete_prefix(txn, db, prefix)
        self.producers.drop_topic(txn, prefix)
        self.heat.drop_topic(txn, topic.id)
        self.consumer_groups.drop_topic(txn, name)
        self.topics.drop(txn, name)

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
            topic = self._topics[op.topic] = self.topics.get(txn, op.topic)
        check_topic_id(op, topic)
        tid, nparts = topic.id, topic.spec.partitions
        counts = [list(span.counts) for span in op.spans]
        check_layout(op, counts, nparts)
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
            nxt = self.producers.spans(
                txn, op, tid, partitions, counts, nxt, index, results, kept, out
            )
        every = all(kept)
        pings: dict[str, int] = {}  # per client, its pings stored by this op
        for n, span in enumerate(op.spans):
            if every or kept[n]:
                pings[span.client_id] = pings.get(span.client_id, 0) + sum(span.counts)
        window = topic.spec.contribution_window_ms or DEFAULT_CONTRIBUTION_WINDOW_MS
        self.heat.record(txn, tid, pings, leader_ms, window)
        for i, part in enumerate(op.parts):
            st = states[i]
            count = nxt[i] - st.next_offset
            if not count:
                continue
            batch = part.batch
            if not every:
                batch = kept_rows(batch, [row[i] for row in counts], kept)
            append_ms = max(leader_ms, st.last_append_ms)  # monotonic per partition
            ref = ref_to(at, i, batch, index) if every else None
            p = part.partition
            self._states[tid, p] = self.pings.store(txn, tid, p, st, count, append_ms, batch, ref)
        return out if results else []

    def _state(self, txn: Any, tid: int, p: int) -> PartitionState:
        """``TopicTables.part_state`` for appends: remembered between them."""
        st = self._states.get((tid, p))
        if st is None:
            st = self._states[tid, p] = self.topics.part_state(txn, tid, p)
        return st

    # ------------------------------------------------------------ retention

    def _trim(self, txn: Any, leader_ms: int) -> None:
        for topic in self.topics.each(txn):
            cutoff = leader_ms - topic.spec.retention_ms
            for p in range(topic.spec.partitions):
                if self.pings.trim_partition(txn, topic.id, p, cutoff):
                    self.refs_released = True  # its log entries may go

    def _trim_heatmaps(self, txn: Any, log_ms: int, keep_newest: int) -> None:
        """Heat maps whose window ended before the log's clock minus their
        topic's retention go, but each topic's newest ``keep_newest`` stay
        (``HeatmapTables.trim``). On the log's clock, which never goes back,
        so a later trim drops at least what an earlier one did."""
        for topic in self.topics.each(txn):
            self.heat.trim(txn, topic.id, log_ms - topic.spec.retention_ms, keep_newest)

    def _expire_records(self, txn: Any, log_ms: int) -> None:
        """Per-client records retention has made useless: contributions
        older than their topic's retention, and producer records of a
        partition none of whose batches is stored any more (a retry of
        those could only be of pings retention deleted)."""
        firsts: dict[tuple[int, int], int] = {}
        for topic in self.topics.each(txn):
            self.heat.expire_contributions(txn, topic.id, log_ms - topic.spec.retention_ms)
            for p in range(topic.spec.partitions):
                firsts[topic.id, p] = self.topics.part_state(txn, topic.id, p).first_offset
        self.producers.expire_records(txn, firsts)

    def producer_refusal(self, pid: int, client_id: str, epoch: int = 0) -> tuple[Code, str] | None:
        """``ProducerTables.refusal`` as of what this replica applied (a data
        group's leader asks group 0's before proposing)."""
        with self.env.begin() as txn:
            return self.producers.refusal(txn, pid, client_id, cached=False, epoch=epoch)

    def expirable_producers(
        self, lifetime_ms: int = PRODUCER_ID_LIFETIME_MS, limit: int = EXPIRED_PRODUCERS_PER_TRIM
    ) -> list[int]:
        """For the leader's trim: producer ids issued more than
        ``lifetime_ms`` before the log's clock with no record left (at most
        ``limit``, the oldest first, looking at most at EXPIRY_SCAN_KEYS
        ids). A read: safe off the applying thread."""
        with self.env.begin() as txn:
            return self.producers.expirable(txn, lifetime_ms, limit)

    def producer_ids_held(self, client_id: str, limit: int = MAX_PRODUCER_IDS_PER_CLIENT) -> int:
        """How many producer ids are bound to ``client_id`` (counted up to
        ``limit``: the quota check needs no more)."""
        with self.env.begin() as txn:
            return self.producers.held(txn, client_id, limit)

    # ---------------------------------------------------------------- reads

    def topic(self, name: str) -> topics_pb2.Topic:
        """The topic record alone (no partition states): for the write path."""
        with self.env.begin() as txn:
            return self.topics.get(txn, name)

    def describe(self, name: str) -> topics_pb2.TopicDescription:
        with self.env.begin() as txn:
            return self.topics.describe(txn, self.topics.get(txn, name))

    def topic_records(self) -> dict[str, topics_pb2.Topic]:
        """Every topic's record by name (no partition states: cheap)."""
        with self.env.begin() as txn:
            return self.topics.by_name(txn)

    def list_topics(self) -> list[topics_pb2.TopicDescription]:
        with self.env.begin() as txn:
            return [self.topics.describe(txn, topic) for topic in self.topics.each(txn)]

    def topics_page(
        self, after: str, limit: int, max_bytes: int
    ) -> tuple[list[topics_pb2.TopicDescription], str]:
        """Topics named after ``after``, in name order: at most ``limit``,
        and no more once ``max_bytes`` are reached (always one, if any is
        left). Returns them and the token of the next page ("": none)."""
        with self.env.begin() as txn:
            return self.topics.page(txn, after, limit, max_bytes)

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

    def identity_counts(self) -> tuple[int, int]:
        """(identities admins made, self-registered ones)."""
        with self.env.begin() as txn:
            return self.clients.counts(txn)

    def describe_group(self, name: str) -> groups_pb2.GroupDescription:
        with self.env.begin() as txn:
            return self.consumer_groups.describe(txn, name)

    def list_groups(
        self, of_topic: Callable[[str], bool] | None = None
    ) -> list[groups_pb2.GroupDescription]:
        """Every group with its offsets, by name; ``of_topic``: only those
        whose topic it holds of (the others are not described)."""
        with self.env.begin() as txn:
            return [
                self.consumer_groups.describe(txn, g.name)
                for g in self.consumer_groups.records(txn)
                if of_topic is None or of_topic(g.topic)
            ]

    def group_records(self) -> list[groups_pb2.Group]:
        """Every consumer group without its offsets (the leader's scan)."""
        with self.env.begin() as txn:
            return self.consumer_groups.records(txn)

    def group_join_refusal(self, op: command_pb2.JoinGroupOp) -> RoadlogError | None:
        """Why the join would pass a group quota (the leader asks first)."""
        with self.env.begin() as txn:
            return self.consumer_groups.quota_refusal(txn, op)

    def monitoring_figures(self) -> tuple[list[TopicFigures], list[ConsumerGroupFigures]]:
        """Per topic and per consumer group, what a node exports for
        monitoring, from one read transaction (safe beside the applier)."""
        with self.env.begin() as txn:
            return monitoring_figures(txn, self.topics, self.heat, self.consumer_groups)

    def heatmap(
        self,
        req: client_pb2.GetHeatmapRequest,
        now_ms: int,
        elsewhere: list[Contribution | None] | None = None,
    ) -> client_pb2.GetHeatmapResponse:
        """A heat map for a contributor: the give-to-get rule first, then the
        map (the latest window unless one is asked for). ``elsewhere``: the
        client's runs of appends in the topic's data groups."""
        with self.env.begin() as txn:
            topic = self.topics.get(txn, req.topic)
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

    def contribution(self, name: str, client_id: str) -> Contribution | None:
        """``client_id``'s run of appends to topic ``name`` here (None: none
        recorded, or no such topic here)."""
        with self.env.begin() as txn:
            topic = self.topics.lookup(txn, name)
            if topic is None:
                return None
            return self.heat.contribution(txn, topic.id, client_id)

    def setting(self, key: str) -> str:
        """A cluster setting's value in force (``settings``)."""
        with self.env.begin() as txn:
            return self.settings.value(txn, key)

    def list_settings(self, key: str = "") -> list[settings_pb2.ClusterSetting]:
        """Every known cluster setting, or ``key``'s (NOT_FOUND if unknown)."""
        with self.env.begin() as txn:
            return self.settings.listing(txn, key)

    def export_topic_state(self, name: str) -> federation_pb2.ExportTopicStateResponse:
        """``TopicMoves.export``: a moving topic's state besides its pings."""
        with self.env.begin() as txn:
            return self.moves.export(txn, name)

    def read_federation(self, read: Callable[[Any, FederationTable], T]) -> T:
        """``read(txn, federation)`` in one read transaction (a directory's)."""
        with self.env.begin() as txn:
            return read(txn, self.federation)

    def read_range(
        self, name: str, partition: int, start: int, end: int, max_pings: int = 200_000
    ) -> tuple[list[client_pb2.StoredBatchView], int]:
        """``PingTables.read_range``: the batches covering offsets [start,
        end) from ``start`` on, and the offset to go on from."""
        self._open_pieces()
        with self.env.begin() as txn:
            return self.pings.read_range(txn, name, partition, start, end, max_pings)

    def fetch(
        self, req: client_pb2.FetchRequest, max_default: int = 10_000
    ) -> client_pb2.FetchResponseView:
        """Pings of one partition from ``req.offset`` on (``PingTables.fetch``)."""
        self._open_pieces()
        with self.env.begin() as txn:
            return self.pings.fetch(txn, req, max_default)[0]

    def offsets_for_window(
        self, name: str, partition: int, start_ms: int, end_ms: int
    ) -> tuple[int, int]:
        """[first offset, end offset) of the batches appended in [start, end)."""
        with self.env.begin() as txn:
            return self.pings.offsets_for_window(txn, name, partition, start_ms, end_ms)

    # ----------------------------------------------------------- durability

    def oldest_entry_ref(self) -> int | None:
        """The lowest log index a stored batch refers to (None: none does):
        the log must keep every entry from there on."""
        with self.env.begin() as txn:
            return oldest_ref(txn, self.topics.parts, self.pings.batches)

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
                (b"topics", self.topics.records),
                (b"parts", self.topics.parts),
                (b"batches", self.pings.batches),
                (b"timeidx", self.pings.timeidx),
                (b"producers", self.producers.records),
                (b"meta", self.meta),
                (b"groups", self.consumer_groups.groups),
                (b"offsets", self.consumer_groups.offsets),
                (b"contrib", self.heat.contrib),
                (b"heatmaps", self.heat.heatmaps),
                (b"clients", self.clients.clients),
            ):
                h.update(name)
                for k, v in txn.cursor(db=db):
                    if db is self.pings.batches:  # the batch whole, however it lies
                        v = batch_store.whole_value(txn, self.pings.more, k, v, self.entries)
                    elif db is self.meta and k == FORMAT_KEY:
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
            check_format(staging)  # a newer release's state: refused, the old one kept
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


def trim_op(
    heatmap_keep_newest: int = HEATMAP_KEEP_NEWEST,
    expired_producers: Sequence[int] = (),
    expire_records: bool = True,
    group_retention_ms: int = GROUP_RETENTION_MS,
    clients_used: Sequence[str] = (),
    forget_idle_clients: bool = False,
) -> command_pb2.Op:
    """The retention op a leader proposes every ``trim_interval_s``: pings,
    heat maps (all but the newest ``heatmap_keep_newest`` windows of a
    topic) and per-client records older than the topic's retention, the
    producer ids ``expirable_producers`` found, consumer groups empty
    for longer than ``group_retention_ms``, and (group 0's) the identities
    seen used and those idle too long (``clients``)."""
    return command_pb2.Op(
        trim=command_pb2.TrimOp(
            heatmap_keep_newest=heatmap_keep_newest,
            expire_records=expire_records,
            expired_producers=expired_producers,
            group_retention_ms=group_retention_ms,
            clients_used=clients_used,
            forget_idle_clients=forget_idle_clients,
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
