"""A group's files as a damaged disk leaves them (``node_daemon.damage``):
a truncated LMDB file is found before LMDB maps it (a SIGBUS otherwise), a
log with a corrupt entry is set aside whole and an empty one opened (the
node then catches up as a wiped one), a sound log is kept as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_daemon import damage
from node_daemon.raft import Entry, HardState
from node_daemon.raft_log import LmdbLogStorage
from node_daemon.state.machine import StateMachine

pytestmark = pytest.mark.unit


def _log(group_dir: Path, n: int = 200) -> None:
    s = LmdbLogStorage(group_dir / "raft")
    s.save(HardState(term=2, vote=1, commit=n), [Entry(2, i, data=os.urandom(500)) for i in
                                                 range(1, n + 1)])  # fmt: skip
    s.close()


def test_a_sound_log_is_kept(tmp_path: Path) -> None:
    _log(tmp_path)
    store, why = damage.open_log(tmp_path)
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
    store, why = damage.open_log(tmp_path)
    assert "entry 150" in why
    assert store.last_index() == 0 and store.initial_state() == HardState()
    store.close()
    [aside] = tmp_path.glob("corrupt-*")
    assert (aside / "raft" / "data.mdb").exists() and (aside / "state").is_dir()
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
         "import sys; from node_daemon.raft_log import LmdbLogStorage as L; "
         "print(L(sys.argv[1]).verify())", str(tmp_path / "raft")],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert child.returncode != 0
    store, why = damage.open_log(tmp_path)
    assert "truncated" in why and store.last_index() == 0
    store.close()


def test_a_file_that_is_not_lmdb_is_damage(tmp_path: Path) -> None:
    (tmp_path / "raft").mkdir()
    (tmp_path / "raft" / "data.mdb").write_bytes(b"\0" * 20000)
    assert "no LMDB meta page" in damage.truncated(tmp_path / "raft")
    store, why = damage.open_log(tmp_path)
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
