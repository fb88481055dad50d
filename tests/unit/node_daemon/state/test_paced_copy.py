"""A snapshot's paced copy: LMDB's own copy byte for byte (pages from a map
of the data file under a read transaction, or, where the file is not as
expected, by LMDB itself), consistent while another thread commits, never
faster than its rate, and a failed copy leaves nothing running or open."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest

from node_daemon.state import paced_copy
from node_daemon.state.paced_copy import CopyCancelled, copy_paced
from tests.conftest import fill_up, small_tmpfs

pytestmark = pytest.mark.unit


def _env(path: Path, mib: int) -> Any:
    env = lmdb.open(str(path), map_size=1 << 30, sync=False, metasync=False)
    with env.begin(write=True) as txn:
        for i in range(mib * 256):  # 4 KiB values: ``mib`` MiB and some
            txn.put(i.to_bytes(8, "big"), i.to_bytes(8, "big") * 512)
    return env


def _items(path: Path) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return list(txn.cursor())
    finally:
        env.close()


def _reference(env: Any, where: Path) -> bytes:
    where.mkdir()
    env.copy(str(where))
    return (where / "data.mdb").read_bytes()


def test_the_copy_is_lmdbs_copy_byte_for_byte(tmp_path: Path) -> None:
    env = _env(tmp_path / "src", 6)
    ref = _reference(env, tmp_path / "ref")
    (tmp_path / "paced").mkdir()
    n = copy_paced(env, tmp_path / "paced" / "data.mdb", sync_bytes=1 << 20)
    env.close()
    paced = (tmp_path / "paced" / "data.mdb").read_bytes()
    assert n == len(paced) > 6 << 20
    assert paced == ref
    assert len(_items(tmp_path / "paced")) == 6 * 256


def test_a_copy_taken_while_another_thread_commits_is_one_transactions_view(
    tmp_path: Path,
) -> None:
    """Commits go on during the copy (overwriting, deleting, adding): the
    copy holds exactly what one transaction saw, every value whole."""
    env = _env(tmp_path / "src", 8)
    stop = threading.Event()
    commits = 0

    def churn() -> None:
        nonlocal commits
        k = 0
        while not stop.is_set() and commits < 5000:
            with env.begin(write=True) as txn:
                for _ in range(20):
                    key = (k % 4000).to_bytes(8, "big")
                    if k % 3:
                        txn.put(key, b"%d" % k * 400)
                    else:
                        txn.delete(key)
                    k += 1
            commits += 1

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        copy_paced(env, tmp_path / "copy.mdb", rate=64 << 20, sync_bytes=1 << 20)
    finally:
        stop.set()
        writer.join()
    env.close()
    (tmp_path / "view").mkdir()
    os.replace(tmp_path / "copy.mdb", tmp_path / "view" / "data.mdb")
    items = dict(_items(tmp_path / "view"))
    assert commits > 0  # the copy did race commits
    # Exactly the state after some number of whole commits: the newest
    # stamp names the last commit the copy saw; replaying the commits up to
    # it over the start gives the copy, key for key.
    stamps = [int(v[: len(v) // 400]) for v in items.values() if v[:1].isdigit() and v[:1] != b"\0"]
    last_op = (max(stamps) // 20 + 1) * 20 if stamps else 0
    expected = {i.to_bytes(8, "big"): i.to_bytes(8, "big") * 512 for i in range(8 * 256)}
    for k in range(last_op):
        key = (k % 4000).to_bytes(8, "big")
        if k % 3:
            expected[key] = b"%d" % k * 400
        else:
            expected.pop(key, None)
    assert items == expected


def test_it_sleeps_to_its_rate(tmp_path: Path) -> None:
    env = _env(tmp_path / "src", 8)
    now = [0.0]  # a clock that moves only when the copy sleeps
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    rate = 4 << 20  # bytes a second
    n = copy_paced(env, tmp_path / "copy.mdb", rate, 1 << 20, clock=lambda: now[0], sleep=sleep)
    env.close()
    # Never ahead of the rate: the time slept is what the bytes take at it.
    assert now[0] == pytest.approx(n / rate, rel=0.01)
    assert len(slept) >= 8 and all(s > 0 for s in slept)


def test_unpaced_it_never_sleeps(tmp_path: Path) -> None:
    env = _env(tmp_path / "src", 2)
    slept: list[float] = []
    assert copy_paced(env, tmp_path / "copy.mdb", None, 1 << 20, sleep=slept.append) > 2 << 20
    env.close()
    assert slept == []


def test_a_buffered_copy_is_synced_every_sync_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the file is written through the page cache (no O_DIRECT), no
    more than ``sync_bytes`` of it waits there."""
    real_open = os.open
    monkeypatch.setattr(
        os,
        "open",
        lambda p, flags, *a: (
            (_ for _ in ()).throw(OSError(errno.EINVAL, "no O_DIRECT"))
            if flags & os.O_DIRECT
            else real_open(p, flags, *a)
        ),
    )
    syncs: list[int] = []
    real_sync = os.fdatasync

    def counted_sync(fd: int) -> None:
        syncs.append(fd)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", counted_sync)
    env = _env(tmp_path / "src", 8)
    ref = _reference(env, tmp_path / "ref")
    n = copy_paced(env, tmp_path / "copy.mdb", None, 1 << 20)
    env.close()
    assert len(syncs) >= n // (1 << 20) - 1 >= 7  # about one per MiB
    assert (tmp_path / "copy.mdb").read_bytes() == ref


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_copy_onto_a_full_disk_raises_and_leaves_nothing_open(tmp_path: Path) -> None:
    env = _env(tmp_path / "src", 4)
    threads, fds = threading.active_count(), _fds()
    with small_tmpfs(tmp_path / "tiny", "2m", "the full-disk copy test") as mnt:
        fill_up(mnt / "fill")
        (mnt / "fill").unlink()
        with pytest.raises(OSError) as err:
            copy_paced(env, mnt / "copy.mdb", None, 1 << 20)
        assert err.value.errno == errno.ENOSPC
    assert threading.active_count() == threads  # no copying thread left
    assert _fds() <= fds  # the data file and the copy are closed
    readers = env.readers().splitlines()[1:]
    assert all(line.split()[-1] == "-" for line in readers), readers  # none left open
    env.close()


def test_a_data_file_laid_out_otherwise_is_copied_by_lmdb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the meta pages are not as this module reads them, LMDB copies
    the environment itself (unpaced): the same bytes."""

    def unexpected(*_: Any) -> int:
        raise paced_copy._Unexpected

    monkeypatch.setattr(paced_copy, "_meta_of", unexpected)
    env = _env(tmp_path / "src", 3)
    ref = _reference(env, tmp_path / "ref")
    slept: list[float] = []
    n = copy_paced(env, tmp_path / "copy.mdb", 1 << 20, sleep=slept.append)
    readers = env.readers().splitlines()[1:]
    env.close()
    assert (tmp_path / "copy.mdb").read_bytes() == ref and n == len(ref)
    assert all(line.split()[-1] == "-" for line in readers), readers  # none left open


def test_a_copy_begun_while_a_commit_is_open_waits_for_it_without_holding_the_gil(
    tmp_path: Path,
) -> None:
    """The copy takes the writer's lock for a moment (to read the meta pages
    as its read transaction sees them). An apply holding that lock and still
    running Python must be able to finish: the wait releases the GIL, and
    the copy then holds the applied commit."""
    env = _env(tmp_path / "src", 1)
    holding, copying = threading.Event(), threading.Event()

    def apply() -> None:
        with env.begin(write=True) as txn:
            holding.set()
            assert copying.wait(10)
            for i in range(200_000):  # Python work while the copy waits for the lock
                if i == 199_999:
                    txn.put(b"applied", b"yes")

    applier = threading.Thread(target=apply)
    applier.start()
    assert holding.wait(10)
    result: list[int] = []
    copier = threading.Thread(
        target=lambda: result.append(copy_paced(env, tmp_path / "copy.mdb", None, 1 << 20))
    )
    copier.start()
    copying.set()
    applier.join(20)
    copier.join(20)
    assert not applier.is_alive() and not copier.is_alive()
    env.close()
    (tmp_path / "view").mkdir()
    os.replace(tmp_path / "copy.mdb", tmp_path / "view" / "data.mdb")
    assert dict(_items(tmp_path / "view")).get(b"applied") == b"yes"


def test_a_cancelled_copy_stops_within_a_chunk_and_leaves_nothing_open(
    tmp_path: Path,
) -> None:
    """A paced copy of a big state takes minutes; a node that stops (or a
    snapshot from the leader that replaces the state) gives it up."""
    env = _env(tmp_path / "src", 8)
    cancel = threading.Event()
    fds = _fds()
    errors: list[BaseException] = []

    def copy() -> None:
        try:
            copy_paced(env, tmp_path / "copy.mdb", 1 << 20, cancel=cancel)  # 8+ s at 1 MiB/s
        except BaseException as e:
            errors.append(e)

    copier = threading.Thread(target=copy)
    copier.start()
    deadline = time.monotonic() + 10
    while not ((tmp_path / "copy.mdb").exists() and (tmp_path / "copy.mdb").stat().st_size):
        assert time.monotonic() < deadline, "the copy never began"
        time.sleep(0.01)
    cancel.set()
    copier.join(10)
    assert not copier.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CopyCancelled)
    assert (tmp_path / "copy.mdb").stat().st_size < (8 << 20)  # it stopped part way
    assert _fds() <= fds
    readers = env.readers().splitlines()[1:]
    assert all(line.split()[-1] == "-" for line in readers), readers
    env.close()
