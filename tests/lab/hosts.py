"""Lab hosts: real systemd machines made with systemd-nspawn on this machine.

Each host boots systemd (`--boot`) over an overlayfs mount whose lower layer
is this machine's root, so it has the same Debian packages (sshd, cron,
Java) without a download; what a host writes lands in its own upper layer.
The hosts sit on a bridge the lab creates (10.77.0.0/24; the bridge is
10.77.0.1 so the controller reaches them) and accept SSH as root with a key
made for the lab.

Invariants: everything is recorded under LAB_ROOT (pid files of the nspawn
processes we started, mount points), so `teardown()` and `clear_leftovers()`
end only our own processes, unmount only our own overlays and remove only
our own bridge. Usable from the command line for manual lab work:

    python -m tests.lab.hosts up --hosts 3     # prints the inventory path
    python -m tests.lab.hosts down
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tests import waiting
from tests.bridge_lock import held_by_another

REPO = Path(__file__).resolve().parents[2]
LAB_ROOT = Path(os.environ.get("ROADLOG_LAB_ROOT", "/var/tmp/roadlog-lab"))
BRIDGE = "rl-lab0"
SUBNET = "10.77.0"
CONTROLLER_IP = f"{SUBNET}.1"
BROADCAST = f"{SUBNET}.255"
# One SSH connection a host, kept open and shared by every command of the lab
# (its own and testinfra's, see ``TESTINFRA_SSH_ARGS``): a new connection per
# command costs a key exchange and a login on both sides, hundreds of times.
# %C is a hash of the local and remote host, port and user.
CONTROL_PATH = LAB_ROOT / "ssh-%C"
# What testinfra's SSH backend is given (ANSIBLE_SSH_EXTRA_ARGS): ansible.cfg's
# ssh_args turn ControlMaster on but name no path, and without one OpenSSH
# shares nothing.
TESTINFRA_SSH_ARGS = f"-o ControlPath={CONTROL_PATH}"

# Units enabled on this machine that a lab host does not need (they would
# only cost CPU, or fight over ports of the machine underneath).
MASKED_UNITS = (
    "postgresql.service",
    "avahi-daemon.service",
    "avahi-daemon.socket",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "exim4-base.timer",
    "exim4.service",
    "fstrim.timer",
    "man-db.timer",
    "systemd-timesyncd.service",
    "getty@tty1.service",
    "console-getty.service",
    # Debian's prometheus (setup installs it for promtool and the lab) and
    # what it recommends: the monitoring role unmasks Prometheus on its host.
    "prometheus.service",
    "prometheus-node-exporter.service",
    "prometheus-node-exporter-apt.timer",
    "prometheus-node-exporter-ipmitool-sensor.timer",
    "prometheus-node-exporter-mellanox-hca-temp.timer",
    "prometheus-node-exporter-nvme.timer",
    "prometheus-node-exporter-smartmon.timer",
    "smartmontools.service",
)

NET_UNIT = """[Unit]
Description=roadlog lab: address on the lab bridge
DefaultDependencies=no
Before=network-online.target ssh.service
Wants=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/sbin/ip link set host0 up
ExecStart=/usr/sbin/ip addr replace {ip}/24 brd {brd} dev host0

[Install]
WantedBy=multi-user.target
"""


def _run(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=timeout)


# tests/waiting.py's wait_for, asking every 0.25 s unless told otherwise
# (WaitTimeout past the deadline).
wait_for = partial(waiting.wait_for, every=0.25)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers kill(0); check its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _port_open(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=0.5) as s:
            return bool(s.recv(4).startswith(b"SSH"))
    except OSError:
        return False


@dataclass(frozen=True)
class LabHost:
    """One lab machine: `lab1` is 10.77.0.11, `lab2` 10.77.0.12, ..."""

    index: int

    @property
    def name(self) -> str:
        return f"lab{self.index}"

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def dir(self) -> Path:
        return LAB_ROOT / self.name

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def pid_file(self) -> Path:
        return self.dir / "nspawn.pid"

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None


class Lab:
    """N hosts on the lab bridge. `up()` builds and boots them and waits for
    sshd on every one; `down()` undoes all of it (also after a failed up)."""

    def __init__(self, count: int = 3) -> None:
        self.hosts = [LabHost(i) for i in range(1, count + 1)]
        self.key = LAB_ROOT / "id_ed25519"
        self.backup_key = LAB_ROOT / "backup.key"  # inventory/lab.ini names it
        self.known_hosts = LAB_ROOT / "known_hosts"  # for fab (ROADLOG_KNOWN_HOSTS)
        self.inventory = LAB_ROOT / "inventory.ini"

    # -- bring up -----------------------------------------------------------

    def up(self, boot_timeout: float = 120) -> None:
        clear_leftovers()
        LAB_ROOT.mkdir(parents=True, exist_ok=True)
        self._make_key()
        self._make_backup_key()
        self._make_bridge()
        for host in self.hosts:
            self._prepare(host)
            self._boot(host)
        for host in self.hosts:
            wait_for(partial(self._ssh_ready, host), boot_timeout, f"sshd on {host.name}")
        self._write_known_hosts()
        self._write_inventory()
        (LAB_ROOT / "lab.json").write_text(
            json.dumps({"hosts": [h.name for h in self.hosts]}, indent=2)
        )

    def _make_key(self) -> None:
        if not self.key.exists():
            _run(
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "roadlog-lab",
                "-f",
                str(self.key),
            )

    def _make_backup_key(self) -> None:
        """The operators' backup key (issue 19, finding 14): 0600, made once."""
        if not self.backup_key.exists():
            fd = os.open(self.backup_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")

    def _make_bridge(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{CONTROLLER_IP}/24", "brd", BROADCAST, "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")

    def _prepare(self, host: LabHost) -> None:
        """An empty upper layer with the lab's few files, mounted over /."""
        for sub in ("upper", "work", "root"):
            (host.dir / sub).mkdir(parents=True, exist_ok=True)
        upper = host.dir / "upper"
        etc = upper / "etc"
        units = etc / "systemd" / "system"
        (units / "multi-user.target.wants").mkdir(parents=True, exist_ok=True)
        (etc / "hostname").write_text(f"{host.name}\n")
        (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{h.ip} {h.name}\n" for h in self.hosts)
        (etc / "hosts").write_text(hosts)
        for unit in MASKED_UNITS:
            link = units / unit
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        (units / "roadlog-lab-net.service").write_text(NET_UNIT.format(ip=host.ip, brd=BROADCAST))
        wants = units / "multi-user.target.wants" / "roadlog-lab-net.service"
        if not wants.is_symlink():
            wants.symlink_to("/etc/systemd/system/roadlog-lab-net.service")
        ssh = upper / "root" / ".ssh"
        ssh.mkdir(parents=True, exist_ok=True)
        ssh.chmod(0o700)
        (ssh / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        (ssh / "authorized_keys").chmod(0o600)
        # The machine underneath may carry our own lab directory and work
        # trees; a host must not see a previous lab's state as its own.
        _run(
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir=/,upperdir={upper},workdir={host.dir / 'work'}",
            str(host.root),
        )

    def _boot(self, host: LabHost) -> None:
        # Each host in its own cgroup: nspawn (--keep-unit) builds the
        # container's tree under the cgroup it runs in, and two hosts sharing
        # one would share (and fight over) their units' cgroups.
        cgroups = cgroup_dirs(host)
        for d in cgroups:
            d.mkdir(parents=True, exist_ok=True)

        def enter_cgroups() -> None:
            for d in cgroups:
                (d / "cgroup.procs").write_text(str(os.getpid()))

        with open(host.console_log, "ab") as out:
            proc = subprocess.Popen(
                [
                    "systemd-nspawn",
                    "--quiet",
                    "--boot",
                    "--register=no",
                    "--keep-unit",
                    f"--network-bridge={BRIDGE}",
                    f"--machine={host.name}",
                    "--console=read-only",
                    "-D",
                    str(host.root),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=enter_cgroups,
            )
        host.pid_file.write_text(str(proc.pid))

    def _ssh_ready(self, host: LabHost) -> bool:
        pid = host.pid()
        if pid is None or not _alive(pid):
            tail = host.console_log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"lab: {host.name} (nspawn) exited during boot:\n{tail}")
        if not _port_open(host.ip, 22):
            return False
        return self.ssh(host, "systemctl is-system-running --wait", check=False).returncode in (
            0,
            1,
        )

    def _write_known_hosts(self) -> None:
        """The hosts' SSH keys, read from their own disks (not from the
        network), so fab checks them (issue 19, finding 17)."""
        lines = []
        for host in self.hosts:
            pubs = sorted(
                (host.root / "etc" / "ssh").glob("ssh_host_*_key.pub"),
                key=lambda p: (0 if "ed25519" in p.name else 1, p.name),  # ed25519 first
            )
            if not pubs:
                raise RuntimeError(f"lab: {host.name} has no SSH host keys in /etc/ssh")
            for pub in pubs:
                kind, blob = pub.read_text().split()[:2]
                lines.append(f"{host.ip},{host.name} {kind} {blob}\n")
        self.known_hosts.write_text("".join(lines))

    def _write_inventory(self) -> None:
        self.inventory.write_text(lab_inventory([h.name for h in self.hosts]))

    # -- use ----------------------------------------------------------------

    def ssh_argv(self, host: LabHost) -> list[str]:
        return [
            "ssh",
            "-i",
            str(self.key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "ControlMaster=auto",
            "-o",
            f"ControlPath={CONTROL_PATH}",
            "-o",
            "ControlPersist=60",
            f"root@{host.ip}",
        ]

    def ssh(
        self, host: LabHost, command: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return _run(*self.ssh_argv(host), command, check=check, timeout=timeout)

    # -- tear down ----------------------------------------------------------

    def down(self) -> None:
        clear_leftovers()


def lab_inventory(names: list[str]) -> str:
    """The committed lab inventory (inventory/lab.ini) with these hosts:
    every host a node and a Spark worker, the first the Spark master, the
    first two queue servers. Its [all:vars] are kept as they are."""
    committed = (REPO / "inventory" / "lab.ini").read_text()
    all_vars = committed[committed.index("[all:vars]") :]
    hosts = {n: f"{SUBNET}.{10 + int(n[3:])}" for n in names}
    groups = {
        "nodes": [f"{n} ansible_host={ip}" for n, ip in hosts.items()],
        "queue_servers": names[:2],
        "spark_master": names[:1],
        "spark_workers": names,
    }
    body = "".join(f"[{g}]\n" + "\n".join(members) + "\n\n" for g, members in groups.items())
    return "# Written by tests/lab/hosts.py from inventory/lab.ini\n" + body + all_vars


def _cgroup_roots() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():  # the unified hierarchy only
        return [base]
    return [p for p in (base / "systemd", base / "unified") if (p / "cgroup.procs").exists()]


def cgroup_dirs(host: LabHost) -> list[Path]:
    return [root / "roadlog-lab" / host.name for root in _cgroup_roots()]


def _remove_cgroups() -> None:
    """The lab's cgroup trees, deepest first (a cgroup goes once it is empty)."""
    for root in _cgroup_roots():
        top = root / "roadlog-lab"
        if not top.exists():
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def _our_mounts() -> list[str]:
    prefix = str(LAB_ROOT) + "/"
    mounts = []
    for line in Path("/proc/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point.startswith(prefix):
            mounts.append(point)
    return mounts


def clear_leftovers(grace: float = 10, timeout: float = 60) -> None:
    """Stop every lab host we started (SIGTERM to its nspawn: a clean
    shutdown; after `grace` seconds every process of a host still running
    is killed through its cgroup, the nspawn's own, and the nspawn is
    SIGKILLed after `timeout`), unmount the overlays, delete the upper
    layers and the bridge. Safe to call when nothing is left."""
    if LAB_ROOT.exists():
        # The shared SSH connections (CONTROL_PATH): their masters are ours.
        for sock in LAB_ROOT.glob("ssh-*"):
            _run("ssh", "-o", f"ControlPath={sock}", "-O", "exit", "lab", check=False, timeout=10)
            sock.unlink(missing_ok=True)
        hosts = [LabHost(int(p.name[3:])) for p in LAB_ROOT.glob("lab*") if p.name[3:].isdigit()]
        running = {
            h: pid
            for h in hosts
            if (pid := h.pid()) is not None and _alive(pid) and _is_nspawn(pid)
        }
        for pid in running.values():
            os.kill(pid, signal.SIGTERM)
        # Nothing of a lab is kept: a host's daemons (a node handing its
        # groups over to peers that are stopping too, Spark's JVMs) are not
        # waited for past the grace (a clean stop of four hosts took 33 s).
        start = time.monotonic()
        for h, pid in running.items():
            while _alive(pid) and time.monotonic() < start + grace:
                _reap(pid)
                time.sleep(0.2)
            if _alive(pid):
                for d in cgroup_dirs(h):
                    with contextlib.suppress(OSError):
                        (d / "cgroup.kill").write_text("1")
        for pid in running.values():
            while _alive(pid) and time.monotonic() < start + timeout:
                _reap(pid)
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                wait_for(partial(_reaped, pid), 30, f"nspawn {pid} to die")
        for point in sorted(_our_mounts(), key=len, reverse=True):
            _run("umount", "-l", point, check=False)
        for host in hosts:
            shutil.rmtree(host.dir, ignore_errors=True)
        # The lab cluster's CA and certificates (inventory/lab.ini): each lab makes its own.
        shutil.rmtree(LAB_ROOT / "pki", ignore_errors=True)
    _remove_cgroups()
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        _run("ip", "link", "del", BRIDGE, check=False)
    # A stopped container's veth goes away with its namespace, which the
    # kernel tears down asynchronously: wait, so a new lab can reuse the name.
    for veth in Path("/sys/class/net").glob("vb-lab*"):
        _run("ip", "link", "del", veth.name, check=False)
    wait_for(lambda: not list(Path("/sys/class/net").glob("vb-lab*")), 30, "old lab veths to go")


def _is_nspawn(pid: int) -> bool:
    try:
        return "systemd-nspawn" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace"
        )
    except OSError:
        return False


def _reaped(pid: int) -> bool:
    _reap(pid)
    return not _alive(pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build and boot the lab hosts")
    up.add_argument("--hosts", type=int, default=3)
    sub.add_parser("down", help="stop the hosts, unmount, remove the bridge")
    args = parser.parse_args(argv)
    # A lab or netns run holds the bridge subnet (tests/bridge_lock.py): its
    # hosts are not these commands' to end.
    held = held_by_another()
    if held is not None:
        print(f"the bridge subnet is in use by {held}: not touching it", file=sys.stderr)
        return 1
    if args.command == "up":
        lab = Lab(args.hosts)
        try:
            lab.up()
        except BaseException:
            lab.down()
            raise
        print(lab.inventory)
    else:
        clear_leftovers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
