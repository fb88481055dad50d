"""CPU spent by server processes over a measured window, read from /proc.

A benchmark names the processes it cares about (label -> pid), calls
``CpuMeter.start()`` when its timed window opens and ``stop()`` when it
closes; the figures are user + system CPU-seconds of each process (all its
threads) over that window. Client processes are left out on purpose: the
figure is what the servers spend, the same for every system compared.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, parent
    pid, ...); ProcessLookupError when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    return stat.rsplit(")", 1)[1].split()


def user_sys(pid: int) -> tuple[float, float]:
    """User and system CPU-seconds of a process so far (every thread).

    Raises ProcessLookupError when the process is gone: a benchmark whose
    server died must not report a figure for it."""
    fields = _stat_fields(pid)
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """user + system CPU-seconds of a process so far (every thread);
    ProcessLookupError when it is gone."""
    return sum(user_sys(pid))


def _parent(pid: int) -> int | None:
    """The parent pid of a process, or None when it is gone."""
    try:
        return int(_stat_fields(pid)[1])
    except ProcessLookupError:
        return None


WORKER_NAME = "roadlog-worker"  # a worker's /proc/PID/comm (node_daemon.process.zygote's)


def _comm(entry: Path) -> str:
    try:
        return (entry / "comm").read_text().strip()
    except OSError:
        return ""


def spawned_children(pid: int) -> list[int]:
    """A node's worker processes, oldest first; not its other children (its
    zygote among them). A worker is a child of the node either way it
    starts: forked by the node's zygote (named WORKER_NAME from its first
    instant: the middle process that forks it names itself first), or
    spawned by multiprocessing (its command line says so from its exec;
    it takes the name when it runs).

    Children are found by each process's parent pid in /proc/*/stat, not by
    /proc/PID/task/PID/children, which the kernel documents as unreliable
    while children start and exit (an entry can be skipped). A spawned
    child caught between its fork and its exec still shows the parent's
    command line and name and is not listed until it has exec'd."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or _parent(int(entry.name)) != pid:
            continue
        if _comm(entry) == WORKER_NAME:
            out.append(int(entry.name))
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmdline and b"spawn_main" in cmdline:
            out.append(int(entry.name))
    return sorted(out)


@dataclass
class CpuMeter:
    """CPU of named processes over one window (``start`` .. ``stop``)."""

    pids: dict[str, int]
    _at_start: dict[str, float] = field(default_factory=dict)
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._at_start = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self, pings: int) -> dict[str, Any]:
        """Figures for the window: ``server_cpu_s`` (all processes),
        ``server_cpu_s_per_m_pings`` (that over the pings acknowledged in
        the window, in millions) and ``cores`` (each process's CPU-seconds
        over the window's seconds: 1.0 is one core kept busy)."""
        if not self._at_start:
            raise RuntimeError("CpuMeter.stop before start")
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        used = {name: cpu_seconds(pid) - self._at_start[name] for name, pid in self.pids.items()}
        total = sum(used.values())
        return {
            "server_cpu_s": round(total, 3),
            "server_cpu_s_per_m_pings": round(total / (pings / 1e6), 3) if pings else None,
            "cores": {name: round(s / elapsed, 3) for name, s in used.items()},
        }
