"""A snapshot's paced copy: the same bytes LMDB's own copy writes, pushed to
the disk ``sync_bytes`` at a time, never faster than its rate, and a failed
copy leaves neither a thread nor a descriptor behind."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest

from node_daemon.state.paced_copy import copy_paced
from tests.conftest import fill_up, small_tmpfs

pytestmark = pytest.mark.unit


def _env(path: Path, mib: int) -> Any:
    env = lmdb.open(str(path), map_size=1 << 30, sync=False)
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


def test_the_copy_is_lmdbs_copy_byte_for_byte(tmp_path: Path) -> None:
    env = _env(tmp_path / "src", 6)
    (tmp_path / "ref").mkdir()
    env.copy(str(tmp_path / "ref"))
    (tmp_path / "paced").mkdir()
    with open(tmp_path / "paced" / "data.mdb", "wb") as f:
        n = copy_paced(env, f.fileno(), sync_bytes=1 << 20)
    env.close()
    paced = (tmp_path / "paced" / "data.mdb").read_bytes()
    assert n == len(paced) > 6 << 20
    assert paced == (tmp_path / "ref" / "data.mdb").read_bytes()
    assert len(_items(tmp_path / "paced")) == 6 * 256


def test_it_syncs_every_sync_bytes_and_sleeps_to_its_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(tmp_path / "src", 8)
    syncs: list[int] = []
    real_sync = os.fdatasync

    def counted_sync(fd: int) -> None:
        syncs.append(fd)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", counted_sync)
    now = [0.0]  # a clock that moves only when the copy sleeps
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    rate = 4 << 20  # bytes a second
    with open(tmp_path / "copy.mdb", "wb") as f:
        n = copy_paced(env, f.fileno(), rate, 1 << 20, clock=lambda: now[0], sleep=sleep)
    env.close()
    assert len(syncs) >= n // (1 << 20) - 1 >= 7  # about one per MiB
    # Never ahead of the rate: the time slept is what the bytes take at it.
    assert now[0] == pytest.approx(n / rate, rel=0.01)
    assert slept and all(s > 0 for s in slept)


def test_unpaced_it_never_sleeps(tmp_path: Path) -> None:
    env = _env(tmp_path / "src", 2)
    slept: list[float] = []
    with open(tmp_path / "copy.mdb", "wb") as f:
        assert copy_paced(env, f.fileno(), None, 1 << 20, sleep=slept.append) > 2 << 20
    env.close()
    assert slept == []


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_copy_onto_a_full_disk_raises_and_leaves_nothing_running(tmp_path: Path) -> None:
    env = _env(tmp_path / "src", 4)
    threads, fds = threading.active_count(), _fds()
    with small_tmpfs(tmp_path / "tiny", "2m", "the full-disk copy test") as mnt:
        fill_up(mnt / "fill")
        (mnt / "fill").unlink()
        with open(mnt / "copy.mdb", "wb") as f, pytest.raises(OSError) as err:
            copy_paced(env, f.fileno(), None, 1 << 20)
        assert err.value.errno == errno.ENOSPC
    env.close()
    assert threading.active_count() == threads  # the copying thread ended
    assert _fds() <= fds  # both ends of the pipe are closed


def test_a_file_system_without_splice_gets_the_same_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_splice(*_: Any) -> int:
        raise OSError(errno.EINVAL, "splice not supported")

    monkeypatch.setattr(os, "splice", no_splice)
    env = _env(tmp_path / "src", 3)
    (tmp_path / "ref").mkdir()
    env.copy(str(tmp_path / "ref"))
    with open(tmp_path / "copy.mdb", "wb") as f:
        copy_paced(env, f.fileno(), None, 1 << 20)
    env.close()
    assert (tmp_path / "copy.mdb").read_bytes() == (tmp_path / "ref" / "data.mdb").read_bytes()
