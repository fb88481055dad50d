"""A node's disk for the nemesis: an ext4 filesystem in an image file,
mounted through a loop device, that can lose power.

A power cut is ext4's shutdown ioctl with ``EXT4_GOING_FLAGS_NOLOGFLUSH``
(what xfstests' power-failure tests use): from that instant every I/O on
the filesystem fails, dirty pages are thrown away and the journal is not
flushed. Unmounted and mounted again, the filesystem replays its journal
and holds what it held on the device at the cut: everything fsynced before,
and of the rest whatever writeback happened to have written, exactly what a
machine that lost power would find at boot.

The images live on a tmpfs of their own (``ImageStore``), so the loop
devices' writes cost memory, not the development machine's disk, while
fsync keeps its meaning inside each filesystem (journal commits).

Invariants: only what is made here is mounted or unmounted here; every
call is bounded in time.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import time
from pathlib import Path

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2  # neither data nor the journal is flushed
MIB = 1 << 20


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def mounted(path: Path) -> bool:
    return os.path.ismount(path)


def unmount(path: Path, timeout: float = 20.0, lazy: bool = True) -> bool:
    """Unmount ``path``, again while it is busy (a process that held a file
    there may take a moment to be gone); at the deadline lazily if ``lazy``
    (never where the filesystem is to be mounted again: a lazily unmounted
    one lives on until its last user is gone). Whether it is unmounted now."""
    deadline = time.monotonic() + timeout
    while mounted(path):
        if _run(["umount", str(path)]).returncode == 0:
            return True
        if time.monotonic() > deadline:
            if lazy:
                _run(["umount", "--lazy", str(path)])
            return not mounted(path)
        time.sleep(0.1)
    return True


class ImageStore:
    """A tmpfs at ``root`` holding the disk images (made and removed here)."""

    def __init__(self, root: Path, size: int) -> None:
        self.root = root
        self.size = size

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0700", "tmpfs", str(self.root)],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    def destroy(self) -> None:
        unmount(self.root)


class Disk:
    """An ext4 image at ``image`` mounted at ``mountpoint``."""

    def __init__(self, image: Path, mountpoint: Path, size: int) -> None:
        self.image = image
        self.mountpoint = mountpoint
        self.size = size

    def create(self) -> None:
        """Make the filesystem (no blocks reserved for root: the disk-full
        faults fill it for everyone) and mount it."""
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        r = _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)])
        if r.returncode != 0:
            raise RuntimeError(f"mkfs.ext4 {self.image}: {r.stderr.strip()}")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.mount()
        (self.mountpoint / "lost+found").rmdir()  # the node's data directory starts empty
        os.chmod(self.mountpoint, 0o700)

    def mount(self) -> None:
        """Mount (replaying the journal after a power cut)."""
        r = _run(["mount", "-o", "loop", str(self.image), str(self.mountpoint)])
        if r.returncode != 0:
            raise RuntimeError(f"mount {self.image}: {r.stderr.strip()}")

    def used(self) -> int:
        st = os.statvfs(self.mountpoint)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def cut_power(self) -> None:
        """Lose everything not on the device yet, at once (the processes
        using the disk must be stopped or dead: their next I/O fails)."""
        fd = os.open(self.mountpoint, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def power_on(self, timeout: float = 20.0) -> None:
        """After a cut, with no process left on it: unmount, wait until the
        filesystem is gone for good (its loop device released: another
        mount namespace's copy keeps it alive, and mounting the image again
        would then bring back the same shut-down filesystem), mount again."""
        if not unmount(self.mountpoint, lazy=False):
            raise RuntimeError(f"{self.mountpoint} stays busy after a power cut")
        deadline = time.monotonic() + timeout
        while self.loop_devices():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.image} stays attached after a power cut")
            time.sleep(0.05)
        self.mount()

    def loop_devices(self) -> list[str]:
        """The loop devices the image is attached to."""
        out = _run(["losetup", "--noheadings", "--output", "NAME", "--associated", str(self.image)])
        return out.stdout.split()

    def destroy(self) -> None:
        unmount(self.mountpoint)
