"""pytest-testinfra checks of deployed hosts, over the Ansible inventory:

    pytest --hosts=ansible://all --ansible-inventory=INV \
        -o python_files='infra_*.py' tests/lab/infra_hosts.py

(the lab test runs exactly this). Each host is checked for what its groups
say it runs: users, files and modes, units enabled and running, ports,
`systemd-analyze security` exposure, the cluster's health, Spark workers.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytestmark = pytest.mark.lab

MAX_EXPOSURE = 2.0  # systemd-analyze security: 0 (sealed) .. 10 (exposed)


def groups(host: Any) -> list[str]:
    return list(host.ansible.get_variables()["group_names"])


CERTS = "/etc/roadlog/certs"
# Finding 13 (issue 19): Spark's master, workers and executors run as their
# own user, with spark.authenticate (role roadlog_spark).
SPARK_USER = "roadlog-spark"
SPARK_CONF = "/etc/roadlog-spark"
SPARK_DIR = "/var/lib/roadlog-spark"


# The metrics ports' bearer token (metrics_auth token, issue 39; role roadlog_common).
METRICS_TOKEN = "/etc/roadlog/metrics_token"


def get_json(host: Any, url: str) -> Any:
    """GET a URL on the host (as root); HTTPS trusting the cluster's CA there,
    with the metrics ports' token where the host has one."""
    script = (
        "import os, ssl, urllib.request, urllib.error\n"
        f"ctx = ssl.create_default_context(cafile={CERTS + '/ca.crt'!r})\n"
        f"ctx = ctx if {url!r}.startswith('https:') else None\n"
        f"req = urllib.request.Request({url!r})\n"
        f"if os.path.exists({METRICS_TOKEN!r}):\n"
        f"    tok = open({METRICS_TOKEN!r}).read().strip()\n"
        "    req.add_header('Authorization', 'Bearer ' + tok)\n"
        "try:\n"
        "    print(urllib.request.urlopen(req, timeout=5, context=ctx).read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.read().decode())\n"
    )
    return json.loads(host.check_output("python3 -c %s", script))


def test_the_roadlog_user_is_a_system_user_without_a_shell(host: Any) -> None:
    user = host.user("roadlog")
    assert user.exists and user.uid < 1000
    assert user.shell == "/usr/sbin/nologin"
    assert user.group == "roadlog"


def test_configuration_and_state_have_their_owners_and_modes(host: Any) -> None:
    secret = host.file("/etc/roadlog/secret")
    assert secret.user == "root" and secret.group == "roadlog" and secret.mode == 0o640
    conf = host.file("/etc/roadlog")
    assert conf.is_directory and conf.mode == 0o750 and conf.group == "roadlog"
    data = host.file("/var/lib/roadlog")
    assert data.user == "roadlog" and data.mode == 0o750
    for conf in ("node.toml", "queue.toml"):  # TLS by default (issue 19)
        f = host.file(f"/etc/roadlog/{conf}")
        if f.exists:
            assert "insecure = false" in f.content_string, conf
            assert f'certs_dir = "{CERTS}"' in f.content_string, conf
    queue = host.file("/etc/roadlog/queue.toml")  # client tokens by default (issue 19)
    if queue.exists:
        assert 'client_auth = "token"' in queue.content_string
    auth = str(host.ansible.get_variables().get("roadlog_common_metrics_auth", "none"))
    token = host.file(METRICS_TOKEN)  # metrics_auth token (issue 39): as the secret
    assert token.exists == (auth == "token"), auth
    if token.exists:
        assert (token.user, token.group, token.mode) == ("root", "roadlog", 0o640)
    assert host.file("/opt/roadlog/venv/bin/roadlog-node").is_file
    assert host.file("/opt/roadlog/wheelhouse/SHA256SUMS").is_file
    if "nodes" in groups(host):
        node_toml = host.file("/etc/roadlog/node.toml")
        assert node_toml.mode == 0o640 and node_toml.group == "roadlog"
        assert "bootstrap_expect" in node_toml.content_string
        assert "peers" not in node_toml.content_string  # discovery forms the cluster
        assert host.file("/var/lib/roadlog/node/node_id").user == "roadlog"
        node_data = host.file("/var/lib/roadlog/node")  # issue 19: data directories 0700
        assert node_data.user == "roadlog" and node_data.mode == 0o700


def units(host: Any) -> list[str]:
    g = groups(host)
    wanted = {
        "roadlog-node": "nodes",
        "roadlog-queue": "queue_servers",
        "spark-master": "spark_master",
        "spark-worker": "spark_workers",
    }
    return [u for u, group in wanted.items() if group in g]


def test_units_are_enabled_and_running(host: Any) -> None:
    assert units(host), "the host runs nothing"
    for unit in units(host):
        service = host.service(unit)
        assert service.is_enabled and service.is_running, unit
    node_type = host.check_output("systemctl show -p Type --value roadlog-node")
    assert node_type == "notify"


def test_a_node_runs_the_data_groups_it_was_founded_with(host: Any) -> None:
    """With ``roadlog_node_data_groups`` at the role's default (0: one per
    voter; issue 18), each node decided three at its first start, recorded
    them in its data directory, and runs a directory per data group."""
    if "nodes" not in groups(host):
        pytest.skip("not a node")
    v = host.ansible.get_variables()
    configured = int(v.get("roadlog_node_data_groups", 0))
    data = "/var/lib/roadlog/node"
    record = host.file(f"{data}/data_groups")
    if configured:
        assert not record.exists
        return
    assert record.exists and record.content_string.strip() == "3"
    for g in (1, 2, 3):
        assert host.file(f"{data}/groups/{g}/raft").is_directory, g


def test_ports_listen(host: Any) -> None:
    """The client-facing and cluster ports on every address; the metrics
    ports (/metrics, /healthz, /readyz) on the host's address on the lab's
    network only (roadlog_node_metrics_host, roadlog_queue_metrics_host:
    issue 19, finding 15), not on every address."""
    g = groups(host)
    ip = host.ansible.get_variables()["ansible_host"]
    expected, metrics = [], []
    if "nodes" in g:
        expected += ["tcp://0.0.0.0:7400", "udp://0.0.0.0:7499"]
        metrics += ["9400"]
        # Each worker process's gRPC and framed peer ports (issue 18):
        # roadlog_node_worker_ports + 2i and + 2i + 1 for worker i.
        v = host.ansible.get_variables()
        workers = int(v.get("roadlog_node_workers", 1))
        base = int(v.get("roadlog_node_worker_ports", 7410))
        if workers > 1:
            expected += [f"tcp://0.0.0.0:{base + p}" for p in range(2 * workers)]
    if "queue_servers" in g:
        # gRPC, the publish link (clients' framed publishes), HTTP.
        expected += ["tcp://0.0.0.0:7500", "tcp://0.0.0.0:7502", "tcp://0.0.0.0:8080"]
        metrics += ["9500"]
    for spec in expected:
        assert host.socket(spec).is_listening, spec
    listening = host.socket.get_listening_sockets()
    for port in metrics:
        assert f"tcp://{ip}:{port}" in listening, (port, listening)
        assert not host.socket(f"tcp://0.0.0.0:{port}").is_listening, (port, listening)
    if "spark_master" in g:  # the JVM binds the host's address (as ::ffff:IP)
        for spark_port in (7077, 8090):
            assert any(s.endswith(f"{ip}:{spark_port}") for s in listening), (spark_port, listening)


def test_units_are_hardened(host: Any) -> None:
    for unit in units(host):
        out = host.check_output(f"systemd-analyze security {unit} --no-pager")
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out)
        assert m, out[-500:]
        assert float(m.group(1)) <= MAX_EXPOSURE, f"{unit}: exposure {m.group(1)}"
        props = host.check_output(
            f"systemctl show -p NoNewPrivileges,ProtectSystem,ProtectHome,PrivateTmp,User {unit}"
        ).splitlines()
        user = SPARK_USER if unit.startswith("spark-") else "roadlog"  # finding 13
        for want in (
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "PrivateTmp=yes",
            f"User={user}",
        ):
            assert want in props, f"{unit}: {want} not in {props}"


def test_prometheus_runs_on_the_monitoring_host_only(host: Any) -> None:
    """roles/roadlog_monitoring, when on: on the Spark master (its default host
    without a [monitoring] group); masked or stopped everywhere else."""
    enabled = str(host.ansible.get_variables().get("roadlog_monitoring_enabled", "false"))
    service = host.service("prometheus")
    if enabled.lower() == "true" and "spark_master" in groups(host):
        assert service.is_enabled and service.is_running
        assert host.socket("tcp://0.0.0.0:9090").is_listening
        config = host.file("/etc/prometheus/prometheus.yml").content_string
        assert "job_name: roadlog-node" in config and "roadlog-rules.yml" in config
        out = host.check_output("systemd-analyze security prometheus --no-pager")
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out)
        assert m and float(m.group(1)) <= MAX_EXPOSURE, out[-500:]
    else:
        assert not service.is_running


def test_the_node_is_a_ready_member(host: Any) -> None:
    if "nodes" not in groups(host):
        pytest.skip("no node on this host")
    ip = host.ansible.get_variables()["ansible_host"]  # where the metrics port binds
    ready = get_json(host, f"https://{ip}:9400/readyz")
    assert ready["ready"] and ready["member"] and ready["leader"] != 0


def test_every_spark_worker_is_registered_with_the_master(host: Any) -> None:
    if "spark_master" not in groups(host):
        pytest.skip("not the Spark master")
    ip = host.ansible.get_variables()["ansible_host"]
    status = get_json(host, f"http://{ip}:8090/json/")
    workers = host.ansible.get_variables()["groups"]["spark_workers"]
    alive = [w for w in status["workers"] if w["state"] == "ALIVE"]
    assert status["status"] == "ALIVE" and len(alive) >= len(workers)
    crontab = host.check_output("crontab -l -u roadlog")
    assert "/opt/roadlog/bin/roadlog-heatmap" in crontab
    assert host.file("/opt/roadlog/spark-env/roadlog-env.tar.gz").mode == 0o644


def spark_secret(host: Any, path: str) -> str:
    lines = host.file(path).content_string.splitlines()
    return str(next(x.split()[1] for x in lines if x.startswith("spark.authenticate.secret ")))


def test_spark_runs_as_its_own_user_that_reads_nothing_of_roadlogs(host: Any) -> None:
    """Finding 13 (issue 19): the Spark master and workers (and so every
    executor) run as a system user of their own, which cannot read the
    cluster secret, the nodes' data or roadlog's keys; Spark's directories
    are its own (0700); spark.authenticate with the shared secret (root, the
    Spark group, 0640), AES-encrypted RPC; executors read nodes with their
    own copy of the Spark reader's certificate."""
    g = groups(host)
    if "spark_master" not in g and "spark_workers" not in g:
        pytest.skip("no Spark on this host")
    user = host.user(SPARK_USER)
    assert user.exists and user.uid < 1000 and user.shell == "/usr/sbin/nologin"
    assert user.groups == [SPARK_USER], user.groups  # not in roadlog's group
    for unit in [u for u in units(host) if u.startswith("spark-")]:
        pid = host.check_output(f"systemctl show -p MainPID --value {unit}")
        assert host.check_output(f"ps -o user:32= -p {pid}").strip() == SPARK_USER, unit
    # The Spark user reads none of roadlog's (as root: only the modes decide).
    as_spark = f"runuser -u {SPARK_USER} --"
    for path in ("/etc/roadlog/secret", f"{CERTS}/node.key", "/var/lib/roadlog/node/node_id"):
        assert host.run(f"{as_spark} cat {path}").rc != 0, path
    assert host.run(f"{as_spark} ls /var/lib/roadlog").rc != 0
    for d in (SPARK_DIR, f"{SPARK_DIR}/logs", f"{SPARK_DIR}/tmp"):
        f = host.file(d)
        assert f.is_directory and (f.user, f.mode) == (SPARK_USER, 0o700), (d, f.user, oct(f.mode))
    conf = host.file(f"{SPARK_CONF}/spark-defaults.conf")
    assert (conf.user, conf.group, conf.mode) == ("root", SPARK_USER, 0o640)
    for want in ("spark.authenticate true", "spark.network.crypto.enabled true",
                 "spark.master.rest.enabled false"):  # fmt: skip
        assert want in conf.content_string, want
    assert len(spark_secret(host, f"{SPARK_CONF}/spark-defaults.conf")) >= 64
    if "spark_workers" in g:  # executors: their own copy of the reader's certificate
        key = host.file(f"{SPARK_CONF}/certs/client.spark.key")
        assert (key.user, key.mode) == (SPARK_USER, 0o600), (key.user, oct(key.mode))
        assert host.run(f"{as_spark} cat {SPARK_CONF}/certs/client.spark.key").rc == 0
        assert host.file(f"{SPARK_DIR}/work").user == SPARK_USER
        env = host.check_output("systemctl show -p Environment --value spark-worker")
        assert f"ROADLOG_KEY_FILE={SPARK_CONF}/certs/client.spark.key" in env.split(), env
    if "spark_master" in g:
        # The driver (roadlog) submits with the same secret, from a file of its own.
        job = host.file("/etc/roadlog/spark-job.conf")
        assert (job.user, job.group, job.mode) == ("root", "roadlog", 0o640)
        assert spark_secret(host, "/etc/roadlog/spark-job.conf") == spark_secret(
            host, f"{SPARK_CONF}/spark-defaults.conf"
        )
        log = host.check_output(
            "journalctl -u spark-master --no-pager -o cat | grep 'SecurityManager: auth'"
        )
        assert "authentication enabled" in log.splitlines()[-1], log[-500:]
        # No REST submission server (it would take applications from anyone).
        listening = host.socket.get_listening_sockets()
        assert not any(s.endswith(":6066") for s in listening), listening


def test_tls_keys_and_certificates_have_their_owners_and_modes(host: Any) -> None:
    """Issue 19: the certificates the roles push; each key 0600, owned by the
    user that reads it (the daemons refuse a key open to its group or
    others); the CA's key on no host."""
    g = groups(host)
    certs = host.file(CERTS)
    assert certs.is_directory and (certs.user, certs.group, certs.mode) == (
        "root",
        "roadlog",
        0o750,
    )
    expected = {"ca.crt": ("root", 0o644)}
    if "nodes" in g:
        expected |= {"node.crt": ("root", 0o644), "node.key": ("roadlog", 0o600)}
    if "queue_servers" in g:
        expected |= {"queue.crt": ("root", 0o644), "queue.key": ("roadlog", 0o600)}
    if "spark_master" in g:  # the Spark reader's driver (executors have their own copy)
        expected |= {"client.spark.crt": ("root", 0o644), "client.spark.key": ("roadlog", 0o600)}
    if "nodes" in g or "queue_servers" in g:  # the operators' (fab's drill probe)
        expected |= {"client.ops.crt": ("root", 0o644), "client.ops.key": ("root", 0o600)}
    present = set(host.check_output(f"ls -A {CERTS}").split())
    assert present == set(expected), present ^ set(expected)
    for name, (user, mode) in expected.items():
        f = host.file(f"{CERTS}/{name}")
        assert f.is_file and (f.user, f.mode) == (user, mode), (name, f.user, oct(f.mode))
    assert host.check_output("find /etc /opt/roadlog /var/lib/roadlog -name ca.key") == ""


def test_the_job_token_is_on_the_spark_master_only_and_private(host: Any) -> None:
    """Issue 19: the heat-map job's token (role roadlog_identities makes it on
    the controller, roadlog_heatmap_cron pushes it) is on the Spark master,
    where the job's driver runs: 0600, the job's user's. No other host has a
    token, and the operators' stays on the controller."""
    found = host.check_output("find /etc/roadlog /opt/roadlog -name '*.token'").split()
    if "spark_master" in groups(host):
        assert found == ["/etc/roadlog/spark.token"], found
        f = host.file("/etc/roadlog/spark.token")
        assert (f.user, f.group, f.mode) == ("roadlog", "roadlog", 0o600), (f.user, oct(f.mode))
        assert f.size > 40  # rl_ and 43 characters
    else:
        assert found == [], found


# Dials the node's and the queue server's ports from the host as clients
# would: gRPC health in plaintext, with TLS but no client certificate, and
# with the operators' client certificate; and the HTTP(S) ports.
PORT_PROBE = r"""
import json, ssl, sys, urllib.error, urllib.request
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
ip, certs, grpc_ports, http_ports = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
read = lambda name: open(f"{certs}/{name}", "rb").read()

def check(channel):
    try:
        with channel as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except grpc.RpcError as e:
        return e.code().name

def get(url, ctx, token=None):
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", "Bearer " + token)
    try:
        return urllib.request.urlopen(req, timeout=5, context=ctx).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return type(e).__name__

try:  # the metrics ports' token (metrics_auth token, issue 39)
    metrics_token = open("/etc/roadlog/metrics_token").read().strip()
except OSError:
    metrics_token = None

out = {}
for port in filter(None, grpc_ports.split(",")):
    t = f"{ip}:{port}"
    out[port] = {
        "plaintext": check(grpc.insecure_channel(t)),
        "tls": check(grpc.secure_channel(t, grpc.ssl_channel_credentials(read("ca.crt")))),
        "tls+cert": check(grpc.secure_channel(t, grpc.ssl_channel_credentials(
            read("ca.crt"), read("client.ops.key"), read("client.ops.crt")))),
    }
ctx = ssl.create_default_context(cafile=f"{certs}/ca.crt")
for port in filter(None, http_ports.split(",")):
    token = metrics_token if port in ("9400", "9500") else None
    out[port] = {
        "plaintext": get(f"http://{ip}:{port}/healthz", None, token),
        "tls": get(f"https://{ip}:{port}/healthz", ctx, token),
        "tls, no token": get(f"https://{ip}:{port}/healthz", ctx),
    }
print(json.dumps(out))
"""


def test_a_plaintext_client_is_refused_on_the_node_and_queue_ports(host: Any) -> None:
    """Issue 19: the node's port is mutual TLS (no certificate, no call), the
    queue server's client port TLS, their HTTP ports HTTPS; a plaintext
    client gets nowhere on any of them, a client with the CA does."""
    g = groups(host)
    grpc_ports = (["7400"] if "nodes" in g else []) + (["7500"] if "queue_servers" in g else [])
    http_ports = (["9400"] if "nodes" in g else []) + (
        ["9500", "8080"] if "queue_servers" in g else []
    )
    if not grpc_ports:
        pytest.skip("neither a node nor a queue server on this host")
    ip = host.ansible.get_variables()["ansible_host"]
    got = json.loads(
        host.check_output(
            "/opt/roadlog/venv/bin/python -c %s %s %s %s %s",
            PORT_PROBE,
            ip,
            CERTS,
            ",".join(grpc_ports),
            ",".join(http_ports),
        )
    )
    for port in grpc_ports:
        assert got[port]["plaintext"] == "UNAVAILABLE", (port, got[port])
        assert got[port]["tls+cert"] == "SERVING", (port, got[port])
    if "nodes" in g:  # mutual: no client certificate, no call
        assert got["7400"]["tls"] == "UNAVAILABLE", got["7400"]
    if "queue_servers" in g:  # clients need no certificate there
        assert got["7500"]["tls"] == "SERVING", got["7500"]
    auth = str(host.ansible.get_variables().get("roadlog_common_metrics_auth", "none"))
    for port in http_ports:
        assert got[port]["tls"] == 200, (port, got[port])
        assert got[port]["plaintext"] != 200, (port, got[port])
        # The metrics ports with metrics_auth token: no token, 401 (issue 39).
        want = 401 if auth == "token" and port in ("9400", "9500") else 200
        assert got[port]["tls, no token"] == want, (port, got[port])
