"""The lab: real systemd hosts (systemd-nspawn) deployed by Ansible.

One lab per session: hosts booted, the wheelhouse built, `site.yml` run.
It is torn down at the end, also when a test or the setup fails, and a
run first clears what an interrupted run left behind (tests/lab/hosts.py).
ROADLOG_LAB_HOSTS=5 deploys five hosts instead of three. One more host is
booted but left out of the inventory: the one `add_node.yml` adds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.bridge_lock import bridge_subnet
from tests.lab.hosts import (
    LAB_ROOT,
    TESTINFRA_SSH_ARGS,
    Lab,
    LabHost,
    cgroup_dirs,
    lab_inventory,
)

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The lab cluster's CA and certificates on this machine (inventory/lab.ini's
# roadlog_tls_controller_dir): the tests dial the cluster as the operators do,
# trusting its CA, with the operators' client certificate (calls to nodes).
PKI = LAB_ROOT / "pki"
HOST_CA = "/etc/roadlog/certs/ca.crt"  # the CA on every lab host
# The metrics ports' bearer token on every lab host (role roadlog_common).
HOST_METRICS_TOKEN = "/etc/roadlog/metrics_token"
# The client identities' tokens the roles keep beside the CA (role
# roadlog_identities): the operators' admin and the heat-map job's.
TOKENS = PKI / "tokens"


def token(name: str = "ops") -> str:
    return (TOKENS / f"{name}.token").read_text().strip()


def metrics_token(inventory: Path) -> str:
    """The metrics ports' bearer token the inventory deploys ("" for none)."""
    for line in inventory.read_text().splitlines():
        k, _, v = line.partition("=")
        if k.strip() == "roadlog_common_metrics_token":
            return v.strip()
    return ""


def tls_env() -> dict[str, str]:
    """The environment the SDK and the CLI dial the lab cluster with: its CA,
    the operators' client certificate and, once the roles made it, the
    operators' admin token (the queue servers ask for one: client_auth token)."""
    client = PKI / "client"
    env = {
        "ROADLOG_CA_FILE": str(client / "ca.crt"),
        "ROADLOG_CERT_FILE": str(client / "client.ops.crt"),
        "ROADLOG_KEY_FILE": str(client / "client.ops.key"),
    }
    if (TOKENS / "ops.token").exists():
        env["ROADLOG_TOKEN"] = token("ops")
    return env


@dataclass
class Deployed:
    lab: Lab
    count: int
    inventory: Path
    timings: dict[str, float] = field(default_factory=dict)
    first_site: str = ""
    testinfra: subprocess.Popen[bytes] | None = None
    testinfra_started: float = 0.0

    @property
    def testinfra_out(self) -> Path:
        return self.lab.inventory.with_name("testinfra.out")

    def start_testinfra(self) -> None:
        """Start testinfra's checks of the hosts (tests/lab/infra_hosts.py),
        beside the next tests: they only read the hosts, and the tests before
        test_hosts_pass_testinfra change nothing on them (the second
        site.yml run must change nothing, and says so if it did)."""
        with open(self.testinfra_out, "wb") as out:
            self.testinfra = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "lab",
                 "--hosts=ansible://all", f"--ansible-inventory={self.inventory}",
                 "-o", "python_files=infra_*.py", "tests/lab/infra_hosts.py"],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}",
                     "ANSIBLE_SSH_EXTRA_ARGS": TESTINFRA_SSH_ARGS, CHECKS_ONLY: "1"},
            )  # fmt: skip
        self.testinfra_started = time.monotonic()

    def testinfra_result(self, timeout: float) -> tuple[int, str]:
        """testinfra's exit status and output, once it ended (started by
        ``start_testinfra``); what it cost the test that waits is timed."""
        assert self.testinfra is not None, "testinfra was not started"
        t0 = time.monotonic()
        rc = self.testinfra.wait(timeout)
        self.timings["testinfra (waited)"] = time.monotonic() - t0
        self.timings["testinfra (ended after)"] = time.monotonic() - self.testinfra_started
        return rc, self.testinfra_out.read_text(errors="replace")

    def stop_testinfra(self) -> None:
        """End testinfra if it still runs (its test was not run, or failed)."""
        if self.testinfra is not None and self.testinfra.poll() is None:
            self.testinfra.kill()
            self.testinfra.wait(30)

    @property
    def hosts(self) -> list[LabHost]:
        return self.lab.hosts[: self.count]

    @property
    def spare(self) -> LabHost:
        return self.lab.hosts[self.count]

    @property
    def servers(self) -> list[str]:
        return [f"{h.ip}:7500" for h in self.hosts[:2]]

    def host(self, name: str) -> LabHost:
        return next(h for h in self.lab.hosts if h.name == name)

    def ssh(self, host: LabHost | str, command: str, check: bool = True) -> str:
        h = self.host(host) if isinstance(host, str) else host
        return self.lab.ssh(h, command, check=check).stdout

    def local_http(self, host: LabHost | str, port: int, path: str) -> str:
        """GET https://IP:PORT/PATH on a host, from the host (as its own
        services see it), at its address on the lab's network (where the
        roles bind the metrics ports: roadlog_node_metrics_host), trusting
        the cluster's CA there, with the metrics ports' bearer token of the
        host's HOST_METRICS_TOKEN where the roles wrote one (metrics_auth
        token, as the lab runs: inventory/lab.ini)."""
        h = self.host(host) if isinstance(host, str) else host
        url = f"https://{h.ip}:{port}{path}"
        script = (
            "import os, ssl, urllib.request as u\n"
            f"ctx = ssl.create_default_context(cafile={HOST_CA!r})\n"
            f"req = u.Request({url!r})\n"
            f"if os.path.exists({HOST_METRICS_TOKEN!r}):\n"
            f"    tok = open({HOST_METRICS_TOKEN!r}).read().strip()\n"
            "    req.add_header('Authorization', 'Bearer ' + tok)\n"
            "print(u.urlopen(req, timeout=5, context=ctx).read().decode())\n"
        )
        return self.ssh(host, f"python3 -c {shlex.quote(script)}")

    def playbook(self, name: str, *args: str, inventory: Path | None = None) -> str:
        """Run a playbook; returns its output (fails the test on failure)."""
        t0 = time.monotonic()
        runs = sum(1 for k in self.timings if k.split(" #")[0] == name)
        run = f"{name} #{runs + 1}" if runs else name
        task_times = self.lab.inventory.with_name(f"task-times-{len(TASK_TIMES)}.json")
        task_times.unlink(missing_ok=True)
        r = subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", str(inventory or self.inventory),
             f"playbooks/{name}", *args],
            cwd=REPO, capture_output=True, text=True, timeout=1500,
            env={**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1",
                 "ANSIBLE_CALLBACK_PLUGINS": str(CALLBACKS),
                 "ANSIBLE_CALLBACKS_ENABLED": "roadlog_task_times",
                 "ROADLOG_ANSIBLE_TASK_TIMES": str(task_times)},
        )  # fmt: skip
        self.timings[run] = time.monotonic() - t0
        with contextlib.suppress(OSError, ValueError):
            times = json.loads(task_times.read_text())
            slowest = sorted(times.items(), key=lambda kv: -kv[1][0])[:SLOWEST_TASKS]
            TASK_TIMES[run] = {k: round(v[0], 1) for k, v in slowest}
        assert r.returncode == 0, f"{name} failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    def fab(self, *args: str) -> str:
        # fab refuses unknown host keys: the lab's known_hosts holds them.
        env = {**os.environ, "ROADLOG_INVENTORY": str(self.inventory),
               "ROADLOG_KNOWN_HOSTS": str(self.lab.known_hosts)}  # fmt: skip
        env.pop("ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS", None)
        # fab finds the operators' token where the roles keep it (the inventory's
        # roadlog_tls_controller_dir), as an operator's fab does.
        env.pop("ROADLOG_TOKEN", None)
        r = subprocess.run(
            [str(BIN / "fab"), *args], cwd=REPO, capture_output=True, text=True, timeout=600,
            env=env,
        )  # fmt: skip
        assert r.returncode == 0, f"fab {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def roadlog(
        self, *args: str, client: str = "lab-driver", token: str | None = None
    ) -> dict[str, Any]:
        """The CLI's JSON answer ({} for none), as the operators' admin (or
        with ``token``); RuntimeError with its message when it fails."""
        env = {**os.environ, **tls_env(), "ROADLOG_CLIENT_ID": client}
        if token is not None:
            env["ROADLOG_TOKEN"] = token
        r = subprocess.run(
            [str(BIN / "roadlog"), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
            env=env,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip() or r.stdout.strip())
        return dict(json.loads(r.stdout)) if r.stdout.strip() else {}

    def cluster(self) -> dict[str, Any]:
        return self.roadlog("cluster", "status", "--servers", ",".join(self.servers), "--json")


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counters per host."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", output, re.M):
        out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


# Set in testinfra's run (start_testinfra): it checks the lab's hosts, and
# must never make a lab of its own (that would first end the running one).
CHECKS_ONLY = "ROADLOG_LAB_CHECKS_ONLY"


@pytest.fixture(scope="session")
def deployed() -> Iterator[Deployed]:
    if os.environ.get(CHECKS_ONLY):
        raise pytest.UsageError(f"{CHECKS_ONLY} is set: this run checks a lab, it makes none")
    # The bridge subnet is the lab's alone while it runs (tests/bridge_lock.py).
    with bridge_subnet("lab", say=lambda m: print(m, file=sys.__stderr__, flush=True)):
        yield from _deployed()


def _deployed() -> Iterator[Deployed]:
    count = int(os.environ.get("ROADLOG_LAB_HOSTS", "3"))
    lab = Lab(count + 1)
    d: Deployed | None = None
    try:
        t0 = time.monotonic()
        lab.up()
        inventory = lab.inventory.with_name("inventory-deployed.ini")
        inventory.write_text(lab_inventory([h.name for h in lab.hosts[:count]]))
        d = Deployed(lab, count, inventory, {"boot": time.monotonic() - t0})
        t0 = time.monotonic()
        subprocess.run(
            ["./scripts/build_wheelhouse.sh"], cwd=REPO, check=True, capture_output=True,
            env={**os.environ, "PY": sys.executable}, timeout=900,
        )  # fmt: skip
        d.timings["wheelhouse"] = time.monotonic() - t0
        d.first_site = d.playbook("site.yml")
        # The lab's cron starts the heat-map job every minute (inventory/lab.ini):
        # a Spark application each time, a driver and an executor on every
        # worker, for a topic that the drill makes first. cron stays stopped on
        # the Spark master but while the drill waits for the job's heat map (no
        # role manages the cron daemon: the second site.yml does not see it).
        d.ssh(d.hosts[0], "systemctl stop cron")
        d.timings.update({f"{k} to deployed": v for k, v in cpu_seconds(lab).items()})
        d.start_testinfra()
        yield d
    finally:
        if d is not None:
            d.stop_testinfra()
            d.timings.update(cpu_seconds(lab))
        t0 = time.monotonic()
        lab.down()
        if d is not None:
            d.timings["down"] = time.monotonic() - t0
            LAB_TIMINGS.update(d.timings)


def cpu_seconds(lab: Lab) -> dict[str, float]:
    """The CPU time the lab cost so far: its hosts' (their cgroups) and this
    process's with its children (Ansible, testinfra, ssh, the CLI)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    hosts = 0.0
    for h in lab.hosts:
        for d in cgroup_dirs(h):
            with contextlib.suppress(OSError, ValueError):
                stat = dict(line.split() for line in (d / "cpu.stat").read_text().splitlines())
                hosts += int(stat["usage_usec"]) / 1e6
                break
    return {
        "cpu-s hosts": hosts,
        "cpu-s controller": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
    }


# Where the lab's minutes went (boot, wheelhouse, each playbook, testinfra,
# teardown), printed at the end of the session's report.
LAB_TIMINGS: dict[str, float] = {}
# Each playbook run's slowest tasks (seconds summed over its hosts), from the
# callback in callback_plugins/: printed with the timings.
CALLBACKS = Path(__file__).with_name("callback_plugins")
SLOWEST_TASKS = 8
TASK_TIMES: dict[str, dict[str, float]] = {}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if LAB_TIMINGS:
        timings = {k: round(v, 1) for k, v in LAB_TIMINGS.items()}
        terminalreporter.write_line(f"lab timings (s): {json.dumps(timings)}")
    for run, tasks in TASK_TIMES.items():
        terminalreporter.write_line(f"lab slowest tasks of {run} (s): {json.dumps(tasks)}")
