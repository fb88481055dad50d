"""Power loss. The nemesis's power cut (``tests.nemesis.disks``) loses
exactly what a machine losing power loses: a file fsynced (with its
directory) is there after the disk comes back, bytes written but not
fsynced are not. And a node's state machine, which commits without fsync,
is rebuilt rather than trusted after its host went down (RELIABILITY.md,
finding 9)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state import unsynced
from node_daemon.state.machine import StateMachine
from node_daemon.state.responses import OpResult
from roadlog.v1 import command_pb2
from tests.nemesis.disks import MIB, Disk, ImageStore, mounted
from tests.netns.conftest import REPO
from tests.unit.node_daemon.state.test_state_machine import Log, pings

pytestmark = pytest.mark.netns


def _write(path: Path, data: bytes, sync: bool) -> None:
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    if sync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def test_a_power_cut_keeps_what_was_fsynced_and_loses_the_rest(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("mounting disks needs root")
    store = ImageStore(tmp_path / "images", 80 * MIB)
    store.create()
    disk = Disk(store.root / "d.ext4", tmp_path / "mnt", 64 * MIB)
    try:
        disk.create()
        assert mounted(disk.mountpoint) and not any(disk.mountpoint.iterdir())
        kept, lost = disk.mountpoint / "kept", disk.mountpoint / "lost"
        _write(kept, b"a" * 100_000, sync=True)
        _write(lost, b"b" * 100_000, sync=False)
        _write(kept, b"c" * 5_000, sync=False)  # an unsynced append to a synced file
        disk.cut_power()
        with pytest.raises(OSError):  # from the cut on, nothing reaches the disk
            (disk.mountpoint / "after").write_bytes(b"x")
        disk.power_on()
        assert kept.read_bytes() == b"a" * 100_000
        assert not lost.exists()
        _write(disk.mountpoint / "again", b"d", sync=True)  # writable again
    finally:
        disk.destroy()
        store.destroy()
    assert not mounted(disk.mountpoint) and not mounted(store.root)


ENTRIES, SYNCED = 61, 20


def _entries() -> tuple[list[Entry], bytes]:
    """A topic and 60 appends as committed entries, and the digest of a
    state that applied them all (the same in every process)."""
    with tempfile.TemporaryDirectory() as d:
        ref = StateMachine(Path(d) / "ref")
        entries: list[Entry] = []
        log = Log(ref)
        log.results = lambda cmd: _applied(ref, entries, cmd)  # type: ignore[method-assign]
        log.create()
        for k in range(ENTRIES - 1):
            log.append(pings(300, start=k * 300), producer=1, seq=k + 1)
        digest = ref.digest()
        ref.close()
    return entries, digest


def _applied(sm: StateMachine, entries: list[Entry], cmd: command_pb2.Command) -> list[OpResult]:
    e = Entry(1, len(entries) + 1, EntryType.NORMAL, cmd.SerializeToString())
    entries.append(e)
    [res] = sm.apply([e])
    return res


def start_after_power_loss(state: str, boot: str) -> None:
    """(child process) What a node does at start on ``boot``: the guard,
    then the state opened, then its log applied; prints the digest."""
    unsynced.guard(Path(state), boot)
    sm = StateMachine(Path(state), map_size=64 * MIB)
    entries, _ = _entries()
    sm.apply(entries)
    print(sm.digest().hex())
    sm.close()


def _write_back(path: Path, nbytes: int) -> None:
    """Write the first ``nbytes`` of a file to the device now (as the
    kernel's writeback may on its own): sync_file_range(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fd = os.open(path, os.O_RDWR)
    try:
        assert libc.sync_file_range(fd, 0, nbytes, 7) == 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)


def test_a_state_torn_by_a_power_loss_is_rebuilt_from_the_log(tmp_path: Path) -> None:
    """The state machine commits without fsync. A host that loses power
    after the kernel wrote back LMDB's meta pages but not the pages they
    point at leaves a torn environment: opened as it is, the node dies of
    SIGBUS at every start. The boot it was marked on differs from the next
    one, so the node rebuilds the state from its log instead."""
    if os.geteuid() != 0:
        pytest.fail("mounting disks needs root")
    entries, digest = _entries()
    store = ImageStore(tmp_path / "images", 100 * MIB)
    store.create()
    disk = Disk(store.root / "d.ext4", tmp_path / "mnt", 80 * MIB)
    try:
        disk.create()
        state = disk.mountpoint / "state"
        assert not unsynced.guard(state, "boot-1")  # as a node opens it
        sm = StateMachine(state, map_size=64 * MIB)
        sm.apply(entries[:SYNCED])
        sm.checkpoint()
        sm.apply(entries[SYNCED:])  # not synced
        _write_back(state / "data.mdb", 2 * 4096)  # LMDB's two meta pages
        disk.cut_power()
        sm.env.close()
        disk.power_on()
        child = subprocess.run(
            [sys.executable, "-c",
             "import sys; from tests.netns.test_power_cut import start_after_power_loss as s; "
             "s(sys.argv[1], 'boot-2')", str(state)],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
        assert child.stdout.split()[-1] == digest.hex()
    finally:
        disk.destroy()
        store.destroy()


def test_the_unsynced_marker_names_the_boot_until_a_clean_stop(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert not unsynced.guard(state, "boot-1")  # nothing there yet
    StateMachine(state).close()
    assert not unsynced.guard(state, "boot-1") and state.exists()  # a process restart
    assert unsynced.guard(state, "boot-2") and not state.exists()  # the host went down
    StateMachine(state).close()
    unsynced.synced(state)  # a clean stop: checkpointed
    assert not unsynced.guard(state, "boot-3") and state.exists()
