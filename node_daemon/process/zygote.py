"""The node's zygote: worker processes forked from a preloaded process
instead of spawned (issue 41). A spawned worker imported the whole node
again: about 0.4 s (0.7 CPU-s) quiet, 3-5 s under load.

``start`` (``roadlog-node run``, before the event loop) forks the zygote
from the node's main process once its modules are imported (the worker's
among them) and before any gRPC object, LMDB environment, event loop or
Python thread exists. The zygote waits on a socket; ``Zygote.fork`` asks it
for a worker (its entry, its spec and one end of its pipe, passed as a
file descriptor). It forks a middle process, which forks the worker and
exits at once: the node marks itself ``PR_SET_CHILD_SUBREAPER``, so the
worker is reparented to the node and is its child, as a spawned worker
was. The pool watches it with a pidfd and reaps it (``Forked``); what
lists a node's children finds it, named WORKER_NAME
(``/proc/PID/comm``).

Invariants:
- the zygote dies with the node (``PR_SET_PDEATHSIG``; it also stops at its
  socket's end of file) and never makes a gRPC object, an LMDB
  environment, an event loop or a thread, so every fork starts from the
  same clean process (what native libraries start at import, BLAS's
  threads, their own fork handlers see to, as with multiprocessing's
  forkserver);
- a worker sets ``PR_SET_PDEATHSIG`` only once it is the node's child (the
  middle process's exit would kill it otherwise) and then exits at once
  if its parent is not the node (``worker_process._die_with_parent``): a
  SIGKILLed node leaves no worker behind;
- one fork at a time; the reply (the worker's pid) comes once the middle
  process has exited, so the worker is the node's child when the pool
  opens its pidfd;
- any failure of the zygote (gone, an error, no answer in FORK_WAIT_S) is
  a ``ZygoteError``: the pool spawns that worker instead, and logs why.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from node_daemon.config import NodeConfig
from roadlog.placement import MAX_DATA_GROUPS, worker_processes

log = logging.getLogger("roadlog.node.zygote")

WORKER_NAME = "roadlog-worker"  # a forked worker's /proc/PID/comm (at most 15 bytes)
ZYGOTE_NAME = "roadlog-zygote"
FORK_WAIT_S = 10.0  # a fork not answered by then: the zygote is taken for broken
REPARENT_WAIT_S = 5.0  # a new worker waits this long at most to become the node's child
MAX_REQUEST = 1 << 20

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36

Entry = Callable[[Any, Connection, int], None]  # a worker's entry: (spec, pipe, node's pid)


class ZygoteError(RuntimeError):
    """The zygote could not fork a worker (spawn it instead)."""


def _prctl(option: int, arg: int | bytes) -> bool:
    """prctl(2); False where it failed or is not there (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def set_name(name: str) -> None:
    """This process's (its calling thread's) name in /proc/PID/comm."""
    _prctl(PR_SET_NAME, name.encode()[:15])


# ------------------------------------------------------------ node's side


class Zygote:
    """The node's handle on its zygote (a child of the node's main process)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._sock = sock
        self._lock: asyncio.Lock | None = None
        self.broken = ""  # why it is no longer asked ("": it is)

    async def fork(self, entry: Entry, spec: Any, conn: Connection, parent: int) -> int:
        """A worker running ``entry(spec, <conn>, parent)``, forked by the
        zygote; its pid (a child of this process by now). ``conn`` is not
        closed here. Raises ZygoteError."""
        if self.broken:
            raise ZygoteError(self.broken)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                data = pickle.dumps((entry, spec, parent))
                socket.send_fds(self._sock, [data], [conn.fileno()])
                reply = await asyncio.wait_for(
                    asyncio.get_running_loop().sock_recv(self._sock, 4096), FORK_WAIT_S
                )
            except (OSError, TimeoutError, pickle.PicklingError) as e:
                self._break(f"asking the zygote failed: {e!r}")
                raise ZygoteError(self.broken) from None
            except asyncio.CancelledError:  # its answer would be read as the next one's
                self._break("a fork was cancelled")
                raise
            if not reply:
                self._break("the zygote is gone")
                raise ZygoteError(self.broken)
            kind, value = pickle.loads(reply)
            if kind != "pid":
                raise ZygoteError(f"the zygote could not fork: {value}")
            return int(value)

    def _break(self, why: str) -> None:
        """Ask it no more: close its socket (it exits at the end of file),
        kill it and reap it."""
        self.broken = why
        self._sock.close()
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(self.pid, 0)

    def close(self) -> None:
        if not self.broken:
            self._break("closed")


_current: Zygote | None = None


def current() -> Zygote | None:
    """This node's zygote (None: none was started, or it is broken)."""
    z = _current
    return z if z is not None and not z.broken else None


def start_for(cfg: NodeConfig) -> Zygote | None:
    """``start``, for a node that may run worker processes (its data groups
    not yet decided: 0 may come to several)."""
    if worker_processes(cfg.data_groups or MAX_DATA_GROUPS, cfg.workers) <= 1:
        return None
    return start()


def start() -> Zygote | None:
    """Fork this node's zygote (once, from the main process, before any
    thread of its own, gRPC object or LMDB environment); None where it
    cannot be (the pool spawns its workers then)."""
    global _current
    if _current is not None:
        return current()
    if not hasattr(os, "pidfd_open") or not _prctl(PR_SET_CHILD_SUBREAPER, 1):
        log.warning("no zygote here (no pidfd or subreaper): worker processes are spawned")
        return None
    import node_daemon.process.worker_process  # noqa: F401  (the worker's modules, preloaded)

    node = os.getpid()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the zygote
        code = 0
        try:
            ours.close()
            _zygote(theirs, node)
        except BaseException:  # never back into the node's code
            code = 1
            with contextlib.suppress(Exception):
                log.exception("the zygote failed")
        finally:
            os._exit(code)
    theirs.close()
    ours.setblocking(False)
    _current = Zygote(pid, ours)
    log.info("zygote started", extra={"pid": pid})
    return _current


# ------------------------------------------------------------ zygote's side


def _zygote(sock: socket.socket, node: int) -> None:
    """Fork a worker for each request, until the node closes its end."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != node:
        return
    set_name(ZYGOTE_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node decides (as for its workers)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threading.active_count() > 1:
        log.warning("the zygote has Python threads: forks may inherit a held lock")
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 1)
        except InterruptedError:
            continue
        if not data:
            return  # the node closed its end (or exited)
        try:
            if len(fds) != 1:
                raise ValueError(f"a request with {len(fds)} file descriptors, not 1")
            entry, spec, parent = pickle.loads(data)
            reply: tuple[str, Any] = ("pid", _fork_worker(sock, entry, spec, parent, fds[0]))
        except Exception as e:
            reply = ("error", repr(e))
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(pickle.dumps(reply))


def _fork_worker(sock: socket.socket, entry: Entry, spec: Any, parent: int, fd: int) -> int:
    """Fork a middle process that forks the worker and exits; the worker's
    pid, once the middle process is reaped (the worker is the node's then)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = 1
        try:
            os.close(r)
            set_name(WORKER_NAME)  # inherited: the worker is named from its first instant
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _worker(sock, entry, spec, parent, fd, me)  # never returns
            os.write(w, pid.to_bytes(8, "big"))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        got = b""
        while len(got) < 8:
            chunk = os.read(r, 8 - len(got))
            if not chunk:
                break
            got += chunk
    finally:
        os.close(r)
        os.waitpid(middle, 0)
    if len(got) != 8:
        raise RuntimeError("the middle process did not fork the worker")
    return int.from_bytes(got, "big")


def _worker(
    sock: socket.socket, entry: Entry, spec: Any, parent: int, fd: int, middle: int
) -> None:
    """The forked worker: once the node's child (no longer ``middle``'s),
    ``entry``; exits with its status (1 on an exception, as a spawned
    worker's), never returning into the zygote's loop."""
    code = 1
    try:
        sock.close()
        deadline = time.monotonic() + REPARENT_WAIT_S
        while os.getppid() == middle and time.monotonic() < deadline:
            time.sleep(0.0005)  # the middle process exits right after it told our pid
        if os.getppid() == middle:
            log.warning("a forked worker's middle process did not exit: going on")
        entry(spec, Connection(fd), parent)  # it checks its parent is the node
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        with contextlib.suppress(Exception):
            log.exception("a forked worker failed")
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class Forked:
    """A worker the zygote forked, as the pool reads it (what it read of a
    ``multiprocessing`` Process): a child of this process, watched with a
    pidfd (``sentinel``, readable once it exited) and reaped here."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)
        self.exitcode: int | None = None
        self._reap = threading.Lock()  # the loop and the health thread both ask

    def is_alive(self) -> bool:
        with self._reap:
            if self.exitcode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: gone, status unknown
                    self.exitcode = 255
                else:
                    if pid == self.pid:
                        self.exitcode = os.waitstatus_to_exitcode(status)
            return self.exitcode is None

    def kill(self) -> None:
        with self._reap:
            if self.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Its pidfd (once it is no longer watched)."""
        with contextlib.suppress(OSError):
            os.close(self.sentinel)
