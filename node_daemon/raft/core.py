"""RaftCore: the Raft state machine of one node, without any I/O.

Inputs: ``tick()`` (logical time), ``step(message)``, ``propose(data)``,
``propose_conf_change(change)``, ``read_index(context)``,
``transfer_leader(node)``, ``report_snapshot(node, ok)``. Output: ``ready()``
returns a Ready (what to persist, send and apply); the caller does that work
in order and calls ``advance(ready)``. Sending only queues messages.

Features: pre-vote and check-quorum (with a leader lease that makes
followers ignore disruptive votes), the election restriction, pipelined
replication with a per-follower in-flight window, fast backtracking by term,
commitment of current-term entries only, snapshots for followers behind the
compacted log, ReadIndex, leadership transfer, learners and single-server
membership changes (see ``confchange``), and a node that lost its storage
catching up before it votes again (``Config.catching_up``).

The leader counts its own log only once the caller has persisted it (in
``advance``), so a leader may send appends before its own fsync completes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from node_daemon.raft import quorum
from node_daemon.raft.confchange import apply_change
from node_daemon.raft.errors import CompactedError, ProposalDropped
from node_daemon.raft.log import RaftLog
from node_daemon.raft.progress import Progress, ProgressState
from node_daemon.raft.read_only import ReadOnly
from node_daemon.raft.storage import LogStorage
from node_daemon.raft.types import (
    LEADER_STREAM,
    NONE,
    ConfChange,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Message,
    MessageType,
    ReadState,
    Ready,
    Role,
    Snapshot,
    SnapshotMeta,
    SoftState,
)

MT = MessageType
_FROM_LEADER = (MT.APPEND, MT.HEARTBEAT, MT.SNAPSHOT)
_TO_LEADER = (MT.APPEND_RESP, MT.HEARTBEAT_RESP)  # what a follower answers a leader


@dataclass(slots=True)
class Config:
    """Tunables of one node. Times are in ticks."""

    id: int
    election_tick: int = 10  # randomized in [election_tick, 2 * election_tick)
    heartbeat_tick: int = 1
    max_size_per_msg: int = 1 << 20  # bytes of entries in one APPEND
    max_entries_per_msg: int = 4096  # entries in one APPEND
    max_inflight_msgs: int = 256  # APPENDs in flight per follower
    max_inflight_bytes: int = 64 << 20
    max_apply_bytes: int | None = 64 << 20  # committed entries handed out per Ready
    pre_vote: bool = True
    check_quorum: bool = True
    # Tell a follower a new commit index with the next APPEND that carries
    # entries, not with an empty APPEND at once, while writes keep coming:
    # under load that is two messages (and a step on each side) fewer per
    # follower and entry. A write that follows a heartbeat interval without
    # any (an idle cluster's) is told at once, so that followers apply it as
    # soon as they can. A commit index that nothing carried by the second
    # tick goes in an empty APPEND then (heartbeats carry it too): a
    # follower learns a commit at most two ticks late, and at once when the
    # cluster was idle or the caller asks for that (``set_prompt_commit``).
    lazy_commit: bool = False
    # What the state machine had applied when it was reopened. It must be at
    # least the log storage's snapshot index: after a crash between saving a
    # snapshot and installing it, install ``storage.snapshot()`` first.
    applied: int = 0
    # This node may have lost what it persisted (it started with an empty
    # log, as after its disk was wiped, in a cluster that may have run
    # before): it may have acknowledged entries and voted in terms it no
    # longer knows. Until a leader has caught it up it neither votes nor
    # campaigns, and it tells leaders to count it in no commit or read
    # quorum (see ``RaftCore._caught_up``). The caller keeps this across restarts
    # until ``caught_up_durably()``.
    catching_up: bool = False
    # What a granted vote (not a pre-vote) carries for the candidate, opaque
    # to Raft (``Message.context``): the caller's, read as the vote is cast
    # (the node's log clock reading: node_daemon/replica/log_clock.py).
    vote_context: Callable[[], bytes] | None = None

    def validate(self) -> None:
        if self.id <= 0:
            raise ValueError("node id must be positive")
        if self.heartbeat_tick <= 0 or self.election_tick <= self.heartbeat_tick:
            raise ValueError("need 0 < heartbeat_tick < election_tick")
        limits = (self.max_inflight_msgs, self.max_entries_per_msg, self.max_size_per_msg)
        if min(limits) <= 0:
            raise ValueError("message and in-flight limits must be positive")


class RaftCore:
    def __init__(self, config: Config, storage: LogStorage, rng: random.Random) -> None:
        config.validate()
        self.cfg = config
        self.id = config.id
        self.rng = rng
        self.log = RaftLog(storage, config.max_apply_bytes)
        hs = storage.initial_state()
        snap = storage.snapshot().meta
        if config.applied < snap.index:
            # A crash between persisting a snapshot and installing it.
            raise ValueError(
                f"state machine applied {config.applied} is behind the log's snapshot "
                f"{snap.index}: install storage.snapshot() into it first"
            )
        self.conf_history: list[tuple[int, ConfState]] = [(snap.index, snap.conf)]
        for e in storage.config_entries():
            self.conf_history.append((e.index, ConfState.decode(e.data)))
        self.term = hs.term
        self.vote = hs.vote
        self.lead = NONE
        self.role = Role.FOLLOWER
        if hs.commit:
            self.log.commit_to(hs.commit)
        if config.applied > self.log.committed:
            # The commit index is persisted lazily; what was applied was committed.
            self.log.commit_to(min(config.applied, self.log.last_index()))
        if config.applied > self.log.applied:
            self.log.applied_to(min(config.applied, self.log.committed))
        self.prs: dict[int, Progress] = {}
        self.votes: dict[int, bool] = {}
        self.msgs: list[Message] = []
        self.read_states: list[ReadState] = []
        self.read_only = ReadOnly()
        self.pending_reads: list[tuple[bytes, int]] = []
        self.lead_transferee = NONE
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = 0
        self.invalid = 0  # malformed messages dropped
        # Lazy commit (leader): ticks since the last proposal, whether that
        # proposal came after a quiet heartbeat interval, and the commit
        # index at the last tick.
        self._quiet_ticks = 0
        self._leader_ticks = 0  # ticks counted while leader (Progress.heard_at)
        self._lone_write = True
        self._tick_committed = 0
        self.prompt_commit = False
        self._prev_soft = SoftState(NONE, Role.FOLLOWER)
        self._prev_hard = hs
        self._durable_hard = hs  # the hard state of the last advanced Ready
        # Catching up after a lost storage: see Config.catching_up, and
        # _caught_up and known_new_cluster() for its end.
        self.catching_up = config.catching_up
        self._become_follower(self.term, NONE)

    # ------------------------------------------------------------------ state

    @property
    def conf(self) -> ConfState:
        """The configuration in force: the latest one in this node's log."""
        return self.conf_history[-1][1]

    @property
    def conf_index(self) -> int:
        """The log index of the configuration in force (its entry, or the
        snapshot that carries it): committed once ``log.committed`` reaches
        it. Until then a newer leader may not have it."""
        return self.conf_history[-1][0]

    def conf_at(self, index: int) -> ConfState:
        """The configuration in force at ``index`` (latest entry <= index)."""
        for i, c in reversed(self.conf_history):
            if i <= index:
                return c
        return self.conf_history[0][1]

    def promotable(self) -> bool:
        return self.id in self.conf.voters

    def hard_state(self) -> HardState:
        return HardState(self.term, self.vote, self.log.committed)

    def soft_state(self) -> SoftState:
        return SoftState(self.lead, self.role)

    def snapshot_meta_at(self, index: int) -> SnapshotMeta:
        """Metadata for a snapshot of the state machine at ``index`` (which
        must be applied): what the caller passes to ``storage.compact``."""
        if index > self.log.applied:
            raise ValueError(f"index {index} is not applied (applied {self.log.applied})")
        return SnapshotMeta(index, self.log.term(index), self.conf_at(index))

    # ----------------------------------------------------------- role changes

    def _reset(self, term: int) -> None:
        if term != self.term:
            self.term = term
            self.vote = NONE
        self.lead = NONE
        self.election_elapsed = 0
        self.heartbeat_elapsed = 0
        self.randomized_election_timeout = self.rng.randrange(
            self.cfg.election_tick, 2 * self.cfg.election_tick
        )
        self.lead_transferee = NONE
        self.votes = {}
        self.read_only.clear()
        self.pending_reads = []
        self._reset_progress()

    def _reset_progress(self) -> None:
        last = self.log.last_index()
        self.prs = {}
        conf = self.conf
        for node in conf.members:
            self.prs[node] = self._new_progress(node, last + 1, node in conf.learners)
        if self.id in self.prs:
            self.prs[self.id].match = self._stable_last()

    def _new_progress(self, node: int, next_index: int, learner: bool) -> Progress:
        return Progress(
            next_index, self.cfg.max_inflight_msgs, self.cfg.max_inflight_bytes, learner
        )

    def _stable_last(self) -> int:
        """The last index of this node's log that is persisted and current."""
        return min(self.log.unstable.offset - 1, self.log.last_index())

    def _become_follower(self, term: int, lead: int) -> None:
        self._reset(term)
        self.lead = lead
        self.role = Role.FOLLOWER

    def _become_pre_candidate(self) -> None:
        # A pre-candidate keeps its term and vote: a lost pre-vote changes nothing.
        self.role = Role.PRE_CANDIDATE
        self.votes = {}
        self.lead = NONE

    def _become_candidate(self) -> None:
        self._reset(self.term + 1)
        self.vote = self.id
        self.role = Role.CANDIDATE

    def _become_leader(self) -> None:
        self._reset(self.term)
        self.lead = self.id
        self.role = Role.LEADER
        self._quiet_ticks = self.cfg.heartbeat_tick
        self._lone_write = True
        self._tick_committed = self.log.committed
        self.prs[self.id].become_replicate()
        # An empty entry of the new term: committing it commits everything
        # before it (§5.4.2) and tells ReadIndex the leader is current.
        self._append([Entry(self.term, 0, EntryType.NORMAL, b"")])

    # ------------------------------------------------------------------- time

    def tick(self) -> None:
        if self.role == Role.LEADER:
            self._tick_heartbeat()
        else:
            self.election_elapsed += 1
            if self.promotable() and self.election_elapsed >= self.randomized_election_timeout:
                self.election_elapsed = 0
                self._hup(transfer=False)

    def _tick_heartbeat(self) -> None:
        self._leader_ticks += 1
        self.heartbeat_elapsed += 1
        self.election_elapsed += 1
        if self.election_elapsed >= self.cfg.election_tick:
            self.election_elapsed = 0
            if self.cfg.check_quorum and not self._quorum_active():
                self._become_follower(self.term, NONE)
                return
            if self.lead_transferee != NONE:
                self.lead_transferee = NONE  # the transfer timed out
        if self.heartbeat_elapsed >= self.cfg.heartbeat_tick:
            self.heartbeat_elapsed = 0
            self._bcast_heartbeat(b"")
        elif self.cfg.lazy_commit:
            for node, pr in self.prs.items():
                # A commit index known at the last tick and still untold.
                if node != self.id and pr.commit_sent < self._tick_committed:
                    self._send_append(node)  # nothing else told it the commit index
        self._tick_committed = self.log.committed
        self._quiet_ticks += 1

    def _quorum_active(self) -> bool:
        """Check-quorum: did a majority hear from us this election timeout?"""
        active = {self.id}
        for node, pr in self.prs.items():
            if pr.recent_active:  # one catching up too: it hears this leader
                active.add(node)
            if node != self.id:
                pr.recent_active = False
        voters = self.conf.voters
        return len(active & voters) >= quorum.majority(len(voters))

    # -------------------------------------------------------------- elections

    def _hup(self, transfer: bool) -> None:
        if self.role == Role.LEADER or not self.promotable() or self.catching_up:
            return
        if self.cfg.pre_vote and not transfer:
            self._campaign(pre=True, transfer=False)
        else:
            self._campaign(pre=False, transfer=transfer)

    def _campaign(self, pre: bool, transfer: bool) -> None:
        if pre:
            self._become_pre_candidate()
            vote_term = self.term + 1
            mtype = MT.PRE_VOTE
        else:
            self._become_candidate()
            vote_term = self.term
            mtype = MT.VOTE
        self.votes[self.id] = True
        if self._poll() == quorum.VoteResult.WON:
            return
        last = self.log.last_index()
        last_term = self.log.last_term()
        for node in sorted(self.conf.voters):
            if node != self.id:
                self._send(
                    Message(mtype, node, self.id, vote_term, last_term, last, force=transfer)
                )

    def _poll(self) -> quorum.VoteResult:
        result = quorum.vote_result(self.conf.voters, self.votes)
        if result == quorum.VoteResult.WON:
            if self.role == Role.PRE_CANDIDATE:
                self._campaign(pre=False, transfer=False)
            else:
                self._become_leader()
                self._bcast_append()
        elif result == quorum.VoteResult.LOST:
            self._become_follower(self.term, NONE)
        return result

    # ------------------------------------------------------------------- step

    def step(self, m: Message) -> None:
        """Handle one message from a peer. Stale, foreign and malformed
        messages are dropped (malformed ones are counted in ``invalid``);
        none of them raises or breaks this node's invariants."""
        if not self._well_formed(m):
            self.invalid += 1
            return
        if m.term > self.term:
            if m.type in (MT.VOTE, MT.PRE_VOTE):
                in_lease = (
                    self.cfg.check_quorum
                    and self.lead != NONE
                    and self.election_elapsed < self.cfg.election_tick
                )
                if in_lease and not m.force:
                    return  # a leader is alive: do not let a partitioned node disrupt it
            if m.type == MT.PRE_VOTE or (m.type == MT.PRE_VOTE_RESP and not m.reject):
                pass  # pre-votes never change our term
            elif m.type in _FROM_LEADER:
                self._become_follower(m.term, m.frm)
            else:
                self._become_follower(m.term, NONE)
        elif m.term < self.term:
            if m.type in (MT.APPEND, MT.HEARTBEAT):
                # Tell a stale leader about the newer term so that it steps down.
                self._send(Message(MT.APPEND_RESP, m.frm, self.id, self.term))
            elif m.type == MT.PRE_VOTE:
                self._send(Message(MT.PRE_VOTE_RESP, m.frm, self.id, self.term, reject=True))
            return

        if m.type in (MT.VOTE, MT.PRE_VOTE):
            self._handle_vote(m)
        elif self.role == Role.LEADER:
            self._step_leader(m)
        elif self.role == Role.FOLLOWER:
            self._step_follower(m)
        else:
            self._step_candidate(m)

    def _well_formed(self, m: Message) -> bool:
        if m.to != self.id or m.frm <= 0 or m.frm == self.id or m.term <= 0:
            return False
        if min(m.index, m.log_term, m.commit, m.caught_up) < 0 or m.log_term > m.term:
            return False
        if m.type == MT.APPEND:
            expect, prev_term = m.index + 1, m.log_term
            for e in m.entries:
                if e.index != expect or e.term < prev_term or e.term > m.term:
                    return False
                if e.type == EntryType.CONFIG and not ConfState.decodes(e.data):
                    return False  # applying it would fail on every node
                expect, prev_term = expect + 1, e.term
        elif m.entries:
            return False
        if (m.type == MT.SNAPSHOT) != (m.snapshot is not None):
            return False
        if m.snapshot is not None and m.snapshot.meta.term > m.term:
            return False
        return not (m.type == MT.READ_INDEX and not m.context)

    def _handle_vote(self, m: Message) -> None:
        # A node catching up may have voted in this very term, or acknowledged
        # entries the candidate lacks, before it lost its storage: it abstains,
        # unless the candidate is the only other voter, which was then in
        # every majority: it knows every term and holds every committed entry.
        abstain = self.catching_up and self.conf.voters - {self.id} != {m.frm}
        can_vote = not abstain and (
            self.vote == m.frm
            or (self.vote == NONE and self.lead == NONE)
            or (m.type == MT.PRE_VOTE and m.term > self.term)
        )
        resp = MT.VOTE_RESP if m.type == MT.VOTE else MT.PRE_VOTE_RESP
        if can_vote and self.log.is_up_to_date(m.index, m.log_term):
            # Answer with the message's term: a pre-vote asks for a future term.
            ctx = self.cfg.vote_context() if m.type == MT.VOTE and self.cfg.vote_context else b""
            self._send(Message(resp, m.frm, self.id, m.term, context=ctx))
            if m.type == MT.VOTE:
                self.election_elapsed = 0
                self.vote = m.frm
        else:
            self._send(Message(resp, m.frm, self.id, self.term, reject=True))

    def _step_candidate(self, m: Message) -> None:
        if m.type in _FROM_LEADER:
            self._become_follower(m.term, m.frm)
            self._step_follower(m)
            return
        expected = MT.PRE_VOTE_RESP if self.role == Role.PRE_CANDIDATE else MT.VOTE_RESP
        if m.type == expected:
            self.votes[m.frm] = not m.reject
            self._poll()

    def _step_follower(self, m: Message) -> None:
        if m.type in _FROM_LEADER:
            self.election_elapsed = 0
            self.lead = m.frm
            if m.type == MT.APPEND:
                self._handle_append(m)
            elif m.type == MT.HEARTBEAT:
                self._handle_heartbeat(m)
            else:
                self._handle_snapshot(m)
            if self.catching_up and m.caught_up and self.log.match_term(m.caught_up, self.term):
                self._caught_up()
        elif m.type == MT.TIMEOUT_NOW:
            self._hup(transfer=True)
        elif m.type == MT.READ_INDEX_RESP:
            self.read_states.append(ReadState(m.index, m.context))

    def _step_leader(self, m: Message) -> None:
        if m.type == MT.READ_INDEX:
            self._leader_read(m.context, m.frm)
            return
        pr = self.prs.get(m.frm)
        if pr is None:
            return
        released = False
        if m.type in _TO_LEADER:
            pr.heard_at = self._leader_ticks
            released = pr.catching_up and not m.catching_up
            pr.catching_up = m.catching_up  # then it counts in no commit or read quorum
            if not m.catching_up:
                pr.catch_up_mark = 0
        if m.type == MT.APPEND_RESP:
            self._handle_append_resp(m, pr)
        elif m.type == MT.HEARTBEAT_RESP:
            pr.recent_active = True
            pr.probe_sent = False
            if m.index < m.commit and pr.match > m.index:
                # The follower lacks entries it acknowledged (a wiped disk):
                # start over for it rather than wait for the next write.
                pr.match = 0
                pr.become_probe()
            if pr.state == ProgressState.REPLICATE and pr.inflights.full():
                # Appends in the window may be lost: let one more through;
                # a follower with a gap rejects it and we back off to probing.
                pr.inflights.free_first()
            if pr.match < self.log.last_index():
                self._send_append(m.frm)
            if m.context and not m.catching_up:
                self._ack_read(m.context, m.frm)
        if m.catching_up and m.type in _TO_LEADER:
            self._mark_catch_up(pr)
        elif released and self.role == Role.LEADER:
            self._recount()

    # --------------------------------------------------------- the follower

    def _handle_append(self, m: Message) -> None:
        if m.index < self.log.committed:
            self._send(Message(MT.APPEND_RESP, m.frm, self.id, self.term, index=self.log.committed))
            return
        try:
            truncated, last_new, ok = self.log.maybe_append(
                m.index, m.log_term, m.commit, m.entries
            )
        except CompactedError:
            ok = False
        if ok:
            if truncated:
                self._truncate_conf_history(truncated)
            self._record_conf_entries(m.entries)
            self._send(Message(MT.APPEND_RESP, m.frm, self.id, self.term, index=last_new))
            return
        hint_index, hint_term = self.log.find_conflict_by_term(
            min(m.index, self.log.last_index()), m.log_term
        )
        self._send(
            Message(
                MT.APPEND_RESP,
                m.frm,
                self.id,
                self.term,
                log_term=hint_term,
                index=m.index,
                reject=True,
                reject_hint=hint_index,
            )
        )

    def _handle_heartbeat(self, m: Message) -> None:
        self.log.commit_to(min(m.commit, self.log.last_index()))
        # Our last index, and the commit we were told (at most what the leader
        # believes we hold): last < commit means we lost acknowledged entries.
        self._send(
            Message(
                MT.HEARTBEAT_RESP,
                m.frm,
                self.id,
                self.term,
                index=self.log.last_index(),
                commit=m.commit,
                context=m.context,
            )
        )

    def _handle_snapshot(self, m: Message) -> None:
        snap = m.snapshot
        if snap is not None and self._restore(snap):
            index = self.log.last_index()
        else:
            index = self.log.committed
        self._send(Message(MT.APPEND_RESP, m.frm, self.id, self.term, index=index))

    def _restore(self, snap: Snapshot) -> bool:
        meta = snap.meta
        if meta.index <= self.log.committed:
            return False
        if self.log.match_term(meta.index, meta.term):
            self.log.commit_to(meta.index)  # we have it: just fast-forward
            return False
        self.log.restore(snap)
        self.conf_history = [(meta.index, meta.conf)]
        self._sync_progress()
        return True

    def _caught_up(self) -> None:
        """The end of catching up (``Config.catching_up``). The leader says
        (``caught_up``) that its catch-up mark, an entry it appended after
        this node told it that it was catching up, is held by enough voters
        that are not catching up: more than the voters a majority may leave
        out, so at least one of every majority that this node may have
        voted with before it lost its storage; and this node's log holds
        the mark. Those voters took an entry of this term after this node
        lost its storage, so none of the terms it may have voted in is newer
        than this one (such a voter would have refused it); this leader's
        log holds every entry committed before the mark, so now this node's
        does. In this term it votes for no one else (as if it had voted for
        this leader: it may have voted in this term before)."""
        self.catching_up = False
        self.vote = self.lead

    # ------------------------------------------------------------ the leader

    def _handle_append_resp(self, m: Message, pr: Progress) -> None:
        pr.recent_active = True
        if m.reject:
            hint = m.reject_hint
            if m.log_term > 0:
                hint, _ = self.log.find_conflict_by_term(m.reject_hint, m.log_term)
            if pr.maybe_decr_to(m.index, hint, lost_log=m.catching_up):
                if pr.state == ProgressState.REPLICATE:
                    pr.become_probe()
                self._send_append(m.frm)
            return
        was_paused = pr.is_paused()
        if pr.maybe_update(m.index):
            if pr.state == ProgressState.PROBE:
                pr.become_replicate()
            elif pr.state == ProgressState.SNAPSHOT and pr.match + 1 >= self.log.first_index():
                pr.become_probe()
                pr.become_replicate()
            elif pr.state == ProgressState.REPLICATE:
                pr.inflights.free_le(m.index)
            if self._maybe_commit():
                if self.role != Role.LEADER:
                    return
                self._commit_advanced()
            elif was_paused:
                self._send_append(m.frm)
            # Pipelining: fill the window while there is more to send.
            while self._send_append(m.frm, send_empty=False):
                pass
            if (
                self.cfg.lazy_commit
                and pr.match >= self.log.last_index()
                and pr.commit_sent < self.log.committed
                and not self._writes_keep_coming()
            ):
                self._send_append(m.frm)  # caught up, nothing in flight: tell it now
            if m.frm == self.lead_transferee and pr.match == self.log.last_index():
                self._send(Message(MT.TIMEOUT_NOW, m.frm, self.id, self.term))

    def _mark_catch_up(self, pr: Progress) -> None:
        """A follower says it is catching up: append its catch-up mark, an
        empty entry (as a new leader's) that, once enough of the others
        hold it, proves this leader current to it (see ``_caught_up``)."""
        if pr.catch_up_mark or self.role != Role.LEADER:
            return
        pr.catch_up_mark = self._append([Entry(self.term, 0, EntryType.NORMAL, b"")])
        self._bcast_append()

    def _recount(self) -> None:
        """A follower is caught up: what it holds counts now."""
        if self._maybe_commit() and self.role == Role.LEADER:  # (a commit may remove this leader)
            self._commit_advanced()

    def _proven_mark(self, pr: Progress) -> int:
        """``pr``'s catch-up mark once held by more voters that are not
        catching up than a majority may leave out (so by one of every
        majority); else 0."""
        mark = pr.catch_up_mark
        if not mark:
            return 0
        voters = self.conf.voters
        held = 0
        for v in voters:
            p = self.prs.get(v)
            held += p is not None and not p.catching_up and p.match >= mark
        return mark if held > len(voters) - quorum.majority(len(voters)) else 0

    def _maybe_commit(self) -> bool:
        # A follower catching up holds what it acknowledged, but its word
        # must not prove this leader current to it (see _caught_up).
        match = {node: 0 if pr.catching_up else pr.match for node, pr in self.prs.items()}
        index = quorum.committed_index(self.conf.voters, match)
        if not self.log.maybe_commit(index, self.term):
            return False
        if self.pending_reads and self._committed_in_term():
            pending, self.pending_reads = self.pending_reads, []
            for ctx, requester in pending:
                self._leader_read(ctx, requester)
        if self.id not in self.conf.voters and self.conf_history[-1][0] <= self.log.committed:
            self._become_follower(self.term, NONE)  # our removal is committed
        return True

    def _committed_in_term(self) -> bool:
        return self.log.term_or_zero(self.log.committed) == self.term

    def leads_caught_up(self, applied: int) -> bool:
        """Leading, with a state machine that has applied up to ``applied``
        holding every entry committed before this term: the entry at
        ``applied`` is of this term, so this term's first entry (which
        follows all its predecessors committed) is applied. A new leader
        may not know yet that its predecessors' last entries committed;
        until this holds, a write they acknowledged may be missing from its
        state, and nothing may be judged from that state."""
        return self.role == Role.LEADER and self.log.term_or_zero(applied) == self.term

    def _send_append(self, to: int, send_empty: bool = True) -> bool:
        pr = self.prs[to]
        if pr.is_paused():
            return False
        prev = pr.next - 1
        try:
            log_term = self.log.term(prev)
            ents = self.log.entries_from(
                pr.next, self.cfg.max_size_per_msg, self.cfg.max_entries_per_msg
            )
        except CompactedError:
            return self._send_snapshot(to, pr)
        if not ents and not send_empty:
            return False
        nbytes = sum(e.size() for e in ents)
        self._send(
            Message(
                MT.APPEND,
                to,
                self.id,
                self.term,
                log_term,
                prev,
                tuple(ents),
                self.log.committed,
                caught_up=self._proven_mark(pr),
            )
        )
        pr.commit_sent = max(pr.commit_sent, self.log.committed)
        if ents:
            pr.sent_entries(ents[-1].index, nbytes)
        elif pr.state == ProgressState.PROBE:
            pr.probe_sent = True
        return bool(ents)

    def _send_snapshot(self, to: int, pr: Progress) -> bool:
        if not pr.recent_active:
            return False  # do not ship a snapshot to a node that may be down
        snap = self.log.snapshot()
        if snap.is_empty:
            return False
        pr.become_snapshot(snap.meta.index)
        self._send(Message(MT.SNAPSHOT, to, self.id, self.term, snapshot=snap))
        return False

    def _commit_advanced(self) -> None:
        if not self.cfg.lazy_commit:
            self._bcast_append()  # an APPEND, empty if need be, tells the commit index
            return
        last = self.log.last_index()
        keep_coming = self._writes_keep_coming()
        for node, pr in self.prs.items():
            if node == self.id or self._send_append(node, send_empty=False) or keep_coming:
                continue
            if pr.match >= last and pr.commit_sent < self.log.committed:
                self._send_append(node)  # nothing more in flight to carry it: tell it now

    def _writes_keep_coming(self) -> bool:
        """Lazy commit: the last proposal came less than a heartbeat
        interval after the one before, so the next one will likely carry a
        new commit index (see ``Config.lazy_commit``), and no one asked for
        each commit at once."""
        return not (self._lone_write or self.prompt_commit)

    def _bcast_append(self) -> None:
        for node in self.prs:
            if node != self.id:
                self._send_append(node)

    def _bcast_heartbeat(self, context: bytes) -> None:
        for node, pr in self.prs.items():
            if node != self.id:
                commit = min(pr.match, self.log.committed)
                pr.commit_sent = max(pr.commit_sent, commit)
                caught_up = self._proven_mark(pr)
                self._send(
                    Message(
                        MT.HEARTBEAT,
                        node,
                        self.id,
                        self.term,
                        commit=commit,
                        context=context,
                        caught_up=caught_up,
                    )
                )

    def _append(self, ents: Sequence[Entry]) -> int:
        last = self.log.last_index()
        stamped = [Entry(self.term, last + i + 1, e.type, e.data) for i, e in enumerate(ents)]
        self.log.append(stamped)
        self._record_conf_entries(stamped)
        return last + 1

    # -------------------------------------------------------- configuration

    def _record_conf_entries(self, ents: Sequence[Entry]) -> None:
        changed = False
        for e in ents:
            if e.type == EntryType.CONFIG and e.index > self.conf_history[-1][0]:
                self.conf_history.append((e.index, ConfState.decode(e.data)))
                changed = True
        if changed:
            self._sync_progress()

    def _truncate_conf_history(self, index: int) -> None:
        if self.conf_history[-1][0] < index:
            return
        while len(self.conf_history) > 1 and self.conf_history[-1][0] >= index:
            self.conf_history.pop()
        self._sync_progress()

    def _sync_progress(self) -> None:
        """Make ``prs`` follow the configuration in force, keeping progress
        of nodes that stay."""
        conf = self.conf
        for node in list(self.prs):
            if node not in conf.members:
                del self.prs[node]
        nxt = self.log.last_index() + 1
        for node in conf.members:
            pr = self.prs.get(node)
            if pr is None:
                pr = self.prs[node] = self._new_progress(node, nxt, node in conf.learners)
                if node == self.id:
                    pr.match = self._stable_last()
                    if self.role == Role.LEADER:
                        pr.become_replicate()
            pr.is_learner = node in conf.learners
        if self.lead_transferee not in conf.voters:
            self.lead_transferee = NONE

    # ---------------------------------------------------------- public API

    def propose(self, data: bytes) -> int:
        """Append ``data`` as a new entry; returns its index."""
        return self.propose_many([data])

    def propose_many(self, datas: Sequence[bytes]) -> int:
        """Append several entries with one broadcast; returns the first index."""
        self._check_can_propose()
        first = self._append([Entry(0, 0, EntryType.NORMAL, d) for d in datas])
        self._proposed()
        self._bcast_append()
        return first

    def _proposed(self) -> None:
        self._lone_write = self._quiet_ticks >= self.cfg.heartbeat_tick
        self._quiet_ticks = 0

    def propose_conf_change(self, cc: ConfChange) -> int:
        """Append a configuration change; returns its index. Refused while
        another change is uncommitted, before this leader committed an entry
        of its own term, or when the voters of the new configuration that
        are not catching up would not be a majority of it (it could commit
        nothing, and might elect no one, until they are caught up)."""
        self._check_can_propose()
        if self.conf_history[-1][0] > self.log.committed:
            raise ProposalDropped("another configuration change is in progress", self.lead)
        if not self._committed_in_term():
            raise ProposalDropped("the new leader has not committed in its term yet", self.lead)
        try:
            new_conf = apply_change(self.conf, cc)
        except ValueError as e:
            raise ProposalDropped(str(e), self.lead) from e
        catching_up = {v for v, pr in self.prs.items() if pr.catching_up} & new_conf.voters
        if len(new_conf.voters - catching_up) < quorum.majority(len(new_conf.voters)):
            raise ProposalDropped(
                f"nodes {sorted(catching_up)} are catching up: the new configuration would "
                "have no majority of voters that are not",
                self.lead,
            )
        if new_conf.voters != self.conf.voters:
            self._check_live_majority(new_conf.voters)
        index = self._append([Entry(0, 0, EntryType.CONFIG, new_conf.encode())])
        self._proposed()
        self._bcast_append()
        return index

    def _check_live_majority(self, voters: frozenset[int]) -> None:
        """Refuse a change of the voters unless the new voters this leader
        heard from within the last election timeout, and that are not
        catching up, are a majority of them (etcd's strict reconfiguration
        check). A change is in force on the leader once appended: taking
        away a live voter while another one is silently down (or has just
        lost its disk and not said so yet) would leave a configuration that
        can commit nothing, not even its own entry, and whose leader steps
        down holding an entry the others lack, so that no one may be elected
        again (RELIABILITY.md, finding 12)."""
        since = self._leader_ticks - self.cfg.election_tick
        live = {self.id} | {
            v
            for v, pr in self.prs.items()
            if pr.heard_at >= 0 and pr.heard_at >= since and not pr.catching_up
        }
        if len(voters & live) < quorum.majority(len(voters)):
            silent = sorted(voters - live)
            raise ProposalDropped(
                f"voters {silent} of the new configuration have not answered within an election "
                "timeout or are catching up: it would have no working majority",
                self.lead,
            )

    def _check_can_propose(self) -> None:
        if self.role != Role.LEADER:
            raise ProposalDropped("not the leader", self.lead)
        if self.lead_transferee != NONE:
            raise ProposalDropped("leadership transfer in progress", self.lead)

    def set_prompt_commit(self, on: bool) -> None:
        """Lazy commit: while ``on``, a leader tells a caught-up follower each
        new commit index at once, as after an idle spell, not with the next
        entry. For a caller whose followers serve reads that closely follow
        writes (read your writes): they can take them only once they know
        the commit. Off (the default), writes that keep coming carry it."""
        self.prompt_commit = on

    def read_index(self, context: bytes) -> None:
        """Ask for a linearizable read. A ReadState with the same context
        arrives in a later Ready; the read may be served once the state
        machine has applied its index. Contexts must be unique and non-empty."""
        if not context:
            raise ValueError("read context must not be empty")
        if self.role == Role.LEADER:
            self._leader_read(context, self.id)
        elif self.lead != NONE:
            self._send(Message(MT.READ_INDEX, self.lead, self.id, self.term, context=context))
        else:
            raise ProposalDropped("no leader known", NONE)

    def _leader_read(self, context: bytes, requester: int) -> None:
        if not self._committed_in_term():
            self.pending_reads.append((context, requester))
            return
        if self.conf.voters == {self.id}:
            self._answer_read(context, self.log.committed, requester)
            return
        self.read_only.add(context, self.log.committed, requester, self.id)
        self._bcast_heartbeat(context)

    def _ack_read(self, context: bytes, voter: int) -> None:
        acks = self.read_only.ack(context, voter)
        if acks is None:
            return
        voters = self.conf.voters
        if len(acks & voters) < quorum.majority(len(voters)):
            return
        for ctx, req in self.read_only.release_through(context):
            self._answer_read(ctx, req.index, req.requester)

    def _answer_read(self, context: bytes, index: int, requester: int) -> None:
        if requester == self.id:
            self.read_states.append(ReadState(index, context))
        else:
            self._send(
                Message(
                    MT.READ_INDEX_RESP, requester, self.id, self.term, index=index, context=context
                )
            )

    def transfer_leader(self, target: int) -> None:
        """Hand leadership to ``target`` (a voter): catch it up, then tell it
        to campaign at once. Proposals are refused until the transfer ends or
        times out after an election timeout."""
        if self.role != Role.LEADER:
            raise ProposalDropped("not the leader", self.lead)
        if target == self.id:
            return
        if target not in self.conf.voters:
            raise ProposalDropped(f"node {target} is not a voter", self.lead)
        if self.prs[target].catching_up:
            raise ProposalDropped(f"node {target} is catching up", self.lead)
        self.election_elapsed = 0
        self.lead_transferee = target
        pr = self.prs[target]
        if pr.match == self.log.last_index():
            self._send(Message(MT.TIMEOUT_NOW, target, self.id, self.term))
        else:
            self._send_append(target)

    def campaign(self) -> None:
        """Start an election now (as if the election timer fired)."""
        self._hup(transfer=False)

    def known_new_cluster(self) -> None:
        """The caller learned that no member of the cluster was ever past
        its bootstrap (a brand-new cluster): this node, though it started
        empty, cannot have forgotten anything, so it stops catching up."""
        self.catching_up = False

    def caught_up_durably(self) -> bool:
        """Not catching up, and the vote that ended it is on disk: from now
        on the caller need not start this node catching up again."""
        hard = self._durable_hard
        return not self.catching_up and (hard.term, hard.vote) == (self.term, self.vote)

    def report_snapshot(self, to: int, ok: bool) -> None:
        """The transport finished (or failed) sending a snapshot to ``to``."""
        pr = self.prs.get(to)
        if self.role != Role.LEADER or pr is None or pr.state != ProgressState.SNAPSHOT:
            return
        if not ok:
            pr.pending_snapshot = 0
        pr.become_probe()
        pr.probe_sent = True  # wait for a heartbeat response before probing again

    def report_unreachable(self, to: int) -> None:
        """The transport could not deliver to ``to``: stop streaming to it."""
        pr = self.prs.get(to)
        if self.role == Role.LEADER and pr is not None and pr.state == ProgressState.REPLICATE:
            pr.become_probe()

    # ------------------------------------------------------------- Ready

    def _send(self, m: Message) -> None:
        if self.catching_up and m.type in _TO_LEADER:
            m = replace(m, catching_up=True)
        self.msgs.append(m)

    def has_ready(self) -> bool:
        u = self.log.unstable
        return bool(
            self.msgs
            or self.read_states
            or u.entries
            or u.snapshot is not None
            or self.log.has_next_committed()
            or self.hard_state() != self._prev_hard
            or self.soft_state() != self._prev_soft
        )

    def ready(self) -> Ready:
        """What to do next. Call ``advance`` with it before the next ready()."""
        rd = Ready()
        soft = self.soft_state()
        if soft != self._prev_soft:
            rd.soft_state = soft
            self._prev_soft = soft
        hard = self.hard_state()
        if hard != self._prev_hard:
            rd.hard_state = hard
            rd.term_or_vote_changed = (
                hard.term != self._prev_hard.term or hard.vote != self._prev_hard.vote
            )
            rd.must_sync = rd.term_or_vote_changed
            self._prev_hard = hard
        u = self.log.unstable
        rd.entries = list(u.entries)
        rd.snapshot = u.snapshot
        rd.committed_entries = self.log.next_committed()
        rd.messages, self.msgs = self.msgs, []
        rd.read_states, self.read_states = self.read_states, []
        rd.must_sync = rd.must_sync or bool(rd.entries) or rd.snapshot is not None
        return rd

    # ------------------------------------- between ready() and advance()
    # While the caller persists a Ready it may keep stepping the core; these
    # let what needs no new write leave before that write is done.

    def take_early_messages(self) -> list[Message]:
        """The messages that may go out before any write in flight is
        durable (a leader's appends, heartbeats and snapshots), taken from
        those waiting for the next Ready. None while the term or vote
        differs from the last advanced Ready's: a node never speaks for a
        term it could forget."""
        if not self.msgs:
            return []
        if (self.term, self.vote) != (self._durable_hard.term, self._durable_hard.vote):
            return []
        early = [m for m in self.msgs if m.type in LEADER_STREAM]
        if early:
            self.msgs = [m for m in self.msgs if m.type not in LEADER_STREAM]
        return early

    def take_committed(self) -> list[Entry]:
        """Committed entries already on this node's disk (not in a write in
        flight) and not handed out yet, once everything handed out before
        is reported applied (``applied_to``). The caller applies them in
        order and reports that with ``applied_to``; the next Ready starts
        after them."""
        log = self.log
        if log.applied != log.applying or log.unstable.snapshot is not None:
            return []
        return log.next_committed(upto=self._stable_last())

    def applied_to(self, index: int) -> None:
        """The state machine applied everything up to ``index``."""
        self.log.applied_to(index)

    def advance(self, rd: Ready) -> None:
        """The caller persisted, sent and applied everything in ``rd``."""
        if rd.hard_state is not None:
            self._durable_hard = rd.hard_state
        u = self.log.unstable
        if rd.snapshot is not None:
            u.stable_snap_to(rd.snapshot.meta.index)
        if rd.entries:
            last = rd.entries[-1]
            u.stable_to(last.index, last.term)
        if rd.committed_entries:
            self.log.applied_to(rd.committed_entries[-1].index)
        elif rd.snapshot is not None:
            self.log.applied_to(rd.snapshot.meta.index)
        if self.role == Role.LEADER and rd.entries:
            me = self.prs.get(self.id)
            if (
                me is not None
                and me.maybe_update(self._stable_last())
                and self._maybe_commit()
                and self.role == Role.LEADER
            ):
                self._commit_advanced()
