"""Which boot of the host a node runs on: what survives in the page cache
(unsynced writes) and what the monotonic clock measures belong to one boot.

The kernel's boot id by default; a node may be told another file
(``boot_id_file``): the nemesis simulates a host that lost power and booted
again by writing a new id there.
"""

from __future__ import annotations

from pathlib import Path

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID_FILE) -> str:
    """This boot of the host ('' where the system does not say)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""
