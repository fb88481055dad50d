"""A group's files as a damaged disk leaves them (``node_daemon.storage.damage``):
a truncated LMDB file is found before LMDB maps it (a SIGBUS otherwise), a
log with a corrupt entry is set aside whole and an empty one opened (the
node then catches up as a wiped one), a sound log is kept as it is."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from node_daemon.raft import Entry, HardState
from node_daemon.state.machine import StateMachine
from node_daemon.storage import damage
from node_daemon.storage.raft_log import LmdbLogStorage

pytestmark = pytest.mark.unit


def _log(group_dir: Path, n: int = 200) -> None:
    s = LmdbLogStorage(group_dir / "raft")
    s.save(HardState(term=2, vote=1, commit=n), [Entry(2, i, data=os.urandom(500)) for i in
                                                 range(1, n + 1)])  # fmt: skip
    s.close()


def test_a_sound_log_is_kept(tmp_path: Path) -> None:
    _log(tmp_path)
    store, why, _ = damage.open_log(tmp_path)
    assert why == "" and store.last_index() == 200 and store.initial_state().vote == 1
    store.close()
    assert not list(tmp_path.glob("corrupt-*"))


def test_a_log_with_a_corrupt_entry_is_set_aside_and_an_empty_one_opened(tmp_path: Path) -> None:
    _log(tmp_path)
    (tmp_path / "state").mkdir()  # made from that log: it goes too
    (tmp_path / "node_id").write_text("7\n")  # the node's, not the group's: stays
    s = LmdbLogStorage(tmp_path / "raft")
    with s.env.begin(write=True, db=s._log) as txn:
        key = (150).to_bytes(8, "big")
        raw = bytes(txn.get(key) or b"")
        txn.put(key, raw[:100] + bytes([raw[100] ^ 0xFF]) + raw[101:])
    s.close()
    store, why, _ = damage.open_log(tmp_path)
    assert "entry 150" in why
    assert store.last_index() == 0 and store.initial_state() == HardState()
    store.close()
    [aside] = tmp_path.glob("corrupt-*")
    assert (aside / "raft" / "data.mdb").exists()  # the damaged log, for a post-mortem
    assert not (aside / "state").exists()  # made from it: dropped, fetched again
    assert "entry 150" in (aside / "why").read_text()
    assert (tmp_path / "node_id").exists() and not (tmp_path / "state").exists()


def test_a_truncated_log_is_found_before_lmdb_maps_it(tmp_path: Path) -> None:
    _log(tmp_path)
    data = tmp_path / "raft" / "data.mdb"
    assert damage.truncated(tmp_path / "raft") == ""
    os.truncate(data, data.stat().st_size // 2)
    assert "truncated" in damage.truncated(tmp_path / "raft")
    # Mapped as it is, reading it kills the process (what the check spares a node).
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys; from node_daemon.storage.raft_log import LmdbLogStorage as L; "
         "print(L(sys.argv[1]).verify())", str(tmp_path / "raft")],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert child.returncode != 0
    store, why, _ = damage.open_log(tmp_path)
    assert "truncated" in why and store.last_index() == 0
    store.close()


def test_a_file_that_is_not_lmdb_is_damage(tmp_path: Path) -> None:
    (tmp_path / "raft").mkdir()
    (tmp_path / "raft" / "data.mdb").write_bytes(b"\0" * 20000)
    assert "no LMDB meta page" in damage.truncated(tmp_path / "raft")
    store, why, _ = damage.open_log(tmp_path)
    assert why and store.last_index() == 0
    store.close()


def test_a_damaged_state_is_reported(tmp_path: Path) -> None:
    sm = StateMachine(tmp_path / "state")
    sm.checkpoint()
    sm.close()
    assert damage.state_damage(tmp_path / "state") == ""
    data = tmp_path / "state" / "data.mdb"
    with open(data, "r+b") as f:  # both meta pages overwritten
        f.write(b"\xff" * 8192)
    assert damage.state_damage(tmp_path / "state")


def test_a_file_shorter_than_its_meta_counts_but_whole_is_kept(tmp_path: Path) -> None:
    """LMDB never writes pages it allocated and freed in one transaction, so
    a healthy file may be shorter than its meta page's last page says: the
    size check only raises a suspicion, which reading it whole (in a child
    process) clears."""
    _log(tmp_path)
    data = tmp_path / "raft" / "data.mdb"
    raw = bytearray(data.read_bytes())
    (psize,) = struct.unpack_from("<I", raw, damage._PSIZE_AT)
    metas = [(struct.unpack_from("<Q", raw, off + damage._LAST_AT + 8)[0], off)
             for off in (0, psize)]  # fmt: skip
    _, newest = max(metas)
    last = struct.unpack_from("<Q", raw, newest + damage._LAST_AT)[0]
    struct.pack_into("<Q", raw, newest + damage._LAST_AT, last + 3)  # 3 pages never written
    data.write_bytes(bytes(raw))
    assert "truncated" in damage.truncated(tmp_path / "raft")
    store, why, _ = damage.open_log(tmp_path)
    assert why == "" and store.last_index() == 200
    store.close()
    assert not list(tmp_path.glob("corrupt-*"))


def test_a_set_aside_log_hands_back_its_term_and_vote_and_a_lone_node_refuses(
    tmp_path: Path,
) -> None:
    """The node keeps the term and vote of a damaged log whose records it
    can still read (it held a copy: no peer may take it for a new cluster's,
    and it votes twice in no term); a node that no peer can catch up keeps
    its log where it is and refuses to start."""
    _log(tmp_path)
    s = LmdbLogStorage(tmp_path / "raft")
    with s.env.begin(write=True, db=s._log) as txn:
        txn.delete((100).to_bytes(8, "big"))
    s.close()
    with pytest.raises(damage.DamagedLogError, match="restore"):
        damage.open_log(tmp_path, can_catch_up=False)
    assert not list(tmp_path.glob("corrupt-*"))
    store, why, kept = damage.open_log(tmp_path)
    assert "entry 100" in why and (kept.term, kept.vote) == (2, 1)
    store.close()


def test_only_the_newest_set_aside_copies_are_kept(tmp_path: Path) -> None:
    """Finding 14: every damaged log set aside kept a whole copy of the
    group; a disk that damages logs again and again filled with them (a
    long nemesis run's node: 1.5 GiB of corrupt-* directories)."""
    made = []
    for k in range(4):
        (tmp_path / "raft").mkdir()
        (tmp_path / "raft" / "mark").write_text(str(k))
        made.append(damage.set_aside(tmp_path, f"damage {k}"))
    kept = sorted(tmp_path.glob("corrupt-*"))
    assert len(kept) == damage.KEEP_SET_ASIDE == 2
    assert set(kept) == set(made[-2:])
    assert [(d / "raft" / "mark").read_text() for d in made[-2:] if d is not None] == ["2", "3"]


def test_a_damaged_log_on_a_disk_with_no_room_for_its_copy_is_removed(tmp_path: Path) -> None:
    """Finding 20: setting a damaged log aside on a full disk died of ENOSPC
    making the directory for the copy, and the node never started. The
    damaged files are removed instead; a new log opens in the room freed."""
    from tests.conftest import fill_up, small_tmpfs

    with small_tmpfs(tmp_path / "disk", "2m", "the no-room set-aside test") as group:
        (group / "raft").mkdir()
        (group / "raft" / "data.mdb").write_bytes(b"\xab" * (256 << 10))  # damaged
        (group / "state").mkdir()
        (group / "state" / "data.mdb").write_bytes(b"\xcd" * (256 << 10))
        fill_up(group / "other")  # the disk is full of something else
        assert damage.set_aside(group, "entry 7 is corrupt") is None
        assert not (group / "raft").exists() and not (group / "state").exists()
        assert not list(group.glob("corrupt-*"))
        store = LmdbLogStorage(group / "raft")  # the group starts empty, in the room freed
        assert store.last_index() == 0
        store.close()


WRITE_AFTER_OPEN = """
import os, sys
from pathlib import Path
from node_daemon.storage import damage
from node_daemon.raft import Entry, HardState
store, why, _ = damage.open_log(Path(sys.argv[1]))
last = store.last_index()
for k in range(20):  # LMDB takes its free pages again
    store.save(HardState(term=3, vote=1, commit=0), [Entry(3, last + k + 1, data=os.urandom(300))])
print(repr(why), store.last_index())
"""


@pytest.mark.parametrize("entries", [5, 20, 40])
def test_a_file_cut_by_its_free_tail_pages_is_usable_after_it_is_kept(
    tmp_path: Path, entries: int
) -> None:
    """Finding 16 (the long nemesis run's node died without a word at its
    first write): a data file cut by one page, a free one, reads whole, so
    it is kept, but LMDB's next use of that page was a SIGBUS. The file is
    extended back (with a hole, as the page was) before LMDB opens it."""
    s = LmdbLogStorage(tmp_path / "raft")
    s.save(HardState(term=2, vote=1, commit=entries),
           [Entry(2, i, data=os.urandom(300)) for i in range(1, entries + 1)])  # fmt: skip
    s.close()
    data = tmp_path / "raft" / "data.mdb"
    os.truncate(data, data.stat().st_size - 4096)
    assert "truncated" in damage.truncated(tmp_path / "raft")
    child = subprocess.run([sys.executable, "-c", WRITE_AFTER_OPEN, str(tmp_path)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, (child.returncode, child.stderr[-500:])
    assert child.stdout.split() == ["''", str(entries + 20)]


def test_set_aside_copies_yield_to_data_on_a_full_disk(tmp_path: Path) -> None:
    """Finding 19: post-mortem copies of damaged logs filled a node's disk
    and it could apply nothing. On a full disk they are removed (group 0's
    and the data groups'), the state takes the room, and nothing else goes."""
    from node_daemon.raft import EntryType, StorageFullError
    from tests.conftest import fill_up, small_tmpfs

    with small_tmpfs(tmp_path / "disk", "4m", "the set-aside room test") as data:
        sm = StateMachine(data / "state")
        for copy in (data / "corrupt-20261127T023922", data / "groups/1/corrupt-20261127T023938"):
            (copy / "raft").mkdir(parents=True)
            (copy / "raft" / "data.mdb").write_bytes(b"\xab" * (512 << 10))
        fill_up(data / "groups" / "1" / "state.fill")  # a data group's data: kept
        entries = [Entry(1, i, EntryType.NORMAL, b"") for i in range(1, 400)]
        with pytest.raises(StorageFullError):
            sm.apply(entries)
        assert damage.drop_set_aside(data) >= 2 * (512 << 10)
        assert not list(data.glob("corrupt-*")) and not list(data.glob("groups/*/corrupt-*"))
        sm.apply(entries)  # the room is the state's now
        assert sm.applied_index == 399
        assert (data / "groups" / "1" / "state.fill").exists()
        sm.close()
        assert damage.drop_set_aside(data) == 0  # nothing left to drop
