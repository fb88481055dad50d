"""Monitoring (issue 20): the alert rules pass `promtool check rules` and
their unit tests (`promtool test rules`), every alert is tested firing and
not firing, the tests catch a broken rule, the Grafana dashboard and the
rules name only metrics roadlog defines, the role scrapes the inventory
(and the streaming heat maps in stream mode), and the metrics added for
them (readiness, ack latency, per-topic ingest, group lag, heat-map age,
the stream's last window and trigger interval) say what they should."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from node_daemon.process.state_metrics import StateCollector
from queue_server.config import QueueConfig
from queue_server.server import QueueServer
from roadlog.errors import RoadlogError
from roadlog.limits import CLIENT_MESSAGE_BYTES
from roadlog.runtime.health import serve_metrics_and_health
from roadlog.v1 import client_pb2, command_pb2, heatmaps_pb2, work_pb2
from spark.jobs.heatmap_stream import Metrics
from tests.unit.node_daemon.state.applying import T0
from tests.unit.node_daemon.state.test_consumer_groups_and_heatmaps import Cluster

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
PROM = ROOT / "monitoring" / "prometheus"
RULES = PROM / "roadlog-rules.yml"
RULES_TEST = PROM / "roadlog-rules.test.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "roadlog.json"
ROLE = ROOT / "roles" / "roadlog_monitoring"
# Where the code defines metrics: every module of these that uses prometheus_client.
PACKAGES = ("node_daemon", "queue_server", "discovery", "roadlog", "spark")
# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up"}
# The issue's alerts: no leader, follower lag, fsync slow, disk nearly full,
# heat map stale, a node not ready.
ISSUE_ALERTS = {
    "RoadlogNoLeader",
    "RoadlogFollowerLag",
    "RoadlogFsyncSlow",
    "RoadlogDiskNearlyFull",
    "RoadlogHeatmapStale",
    "RoadlogNodeNotReady",
}
# The streaming heat map's (issue 20's follow-up): stalled, no window committed
# for three triggers.
STREAM_ALERTS = {"RoadlogHeatmapStreamStalled"}
STREAM_JOB = "roadlog-heatmap-stream"


def promtool() -> str:
    """promtool's path; a failure (not a skip) when it is missing: setup installs it."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: ./scripts/setup.sh installs Debian's prometheus")
    return path


def run_promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------ metric names

_AGGREGATORS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
_KEYWORDS = {"bool", "and", "or", "unless", "offset", "inf", "nan", "atan2"} | _AGGREGATORS


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (also with Grafana's
    $variables in it): every identifier that is not a function, keyword,
    label, string, number or duration."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # strings
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "", e)  # Grafana variables
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges and subqueries
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"(?<![\w:])\d[\w.]*", " ", e)  # numbers and durations
    names: set[str] = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue  # a function or an aggregation
        names.add(m.group(0))
    return names


def test_metric_names_finds_selected_metrics_and_nothing_else() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (instance, le)"
        ' (rate(a_seconds_bucket{x="y"}[$__rate_interval])))'
        ' > 0.1 and on (instance) (b_role == bool 3) or absent(up{job="j"} == 1)'
        " unless scalar(max(c_index)) - c_index offset 5m > 6 * 3600 + 1e3"
        ' or sum(d_total) without (kind) or label_replace(e_x, "dst", "$1", "src", "(.*)")'
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_role", "up", "c_index", "d_total", "e_x"}


def defined_metric_names() -> set[str]:
    """Every sample name the code's metrics expose: imports each module that
    uses prometheus_client, then reads the default registry's families, and
    the streaming heat map's (made when a stream starts) on a registry of
    their own."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if "prometheus_client" in text and re.search(r"\b(Counter|Gauge|Histogram)\b", text):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                importlib.import_module(module)
    suffixes = {
        "counter": ["_total", "_created"],
        "gauge": [""],
        "histogram": ["_bucket", "_count", "_sum", "_created"],
        "summary": ["", "_count", "_sum", "_created"],
        "info": ["_info"],
    }
    names: set[str] = set()
    stream = CollectorRegistry()
    Metrics(stream)
    for family in [*REGISTRY.collect(), *stream.collect()]:
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
        names.update(s.name for s in family.samples)
    return names


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for group in doc["groups"] for r in group["rules"]]


def dashboard_panels() -> list[dict[str, Any]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels of collapsed rows
    return out


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]


def test_the_dashboard_and_the_rules_name_only_metrics_the_code_defines() -> None:
    defined = defined_metric_names() | PROMETHEUS_SERIES
    assert "roadlog_raft_role" in defined and "roadlog_queue_depth" in defined
    assert "roadlog_topic_appended_pings_total" in defined  # the state collector's
    for source, exprs in (
        ("dashboard", dashboard_exprs()),
        ("rules", [r["expr"] for r in rules()]),
    ):
        assert exprs, source
        for expr in exprs:
            unknown = metric_names(expr) - defined
            assert not unknown, f"{source}: {expr!r} names undefined metrics {sorted(unknown)}"


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    wanted = {
        "roadlog_topic_appended_pings_total": "ingest",
        "roadlog_queue_answer_seconds_bucket": "ack latency",
        "roadlog_raft_role": "Raft role",
        "roadlog_raft_term": "term",
        "roadlog_raft_commit_index": "commit lag",
        "roadlog_raft_log_write_seconds_bucket": "fsync latency",
        "roadlog_queue_depth": "queue depths",
        "roadlog_group_lag_pings": "consumer group lag",
        "roadlog_heatmap_last_computed_seconds": "heat-map job age",
    }
    missing = {what for name, what in wanted.items() if name not in used}
    assert not missing, f"the dashboard does not show {sorted(missing)}"


def test_the_dashboard_shows_the_streaming_heat_maps() -> None:
    stream = [
        p
        for p in dashboard_panels()
        if p["type"] != "row" and any(STREAM_JOB in t["expr"] for t in p["targets"])
    ]
    used = set().union(*(metric_names(t["expr"]) for p in stream for t in p["targets"]))
    wanted = {
        "roadlog_heatmap_stream_batch_seconds": "trigger duration",
        "roadlog_heatmap_stream_too_late_pings_total": "too-late pings",
        "roadlog_heatmap_stream_last_window_end_seconds": "last committed window age",
    }
    missing = {what for name, what in wanted.items() if name not in used}
    assert not missing, f"the dashboard does not show {sorted(missing)}"
    ages = [t["expr"] for p in stream for t in p["targets"] if "last_window_end" in t["expr"]]
    assert any(e.startswith("time() - ") for e in ages), "the window's age, not its time"
    # Under their own row, below the others.
    rows = [p for p in dashboard_panels() if p["type"] == "row"]
    assert rows[-1]["title"] == "Streaming heat maps"
    assert all(p["gridPos"]["y"] > rows[-1]["gridPos"]["y"] for p in stream)


def test_the_dashboard_is_well_formed() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "roadlog" and doc["title"] == "roadlog"
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]


# --------------------------------------------------------------- the rules


def test_promtool_checks_the_rules() -> None:
    r = run_promtool("check", "rules", RULES.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    r = run_promtool("test", "rules", RULES_TEST.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_the_rules_hold_the_issue_s_alerts_and_each_is_tested_firing_and_not_firing() -> None:
    alerts = {r["alert"] for r in rules()}
    assert alerts >= ISSUE_ALERTS | STREAM_ALERTS
    doc = yaml.safe_load(RULES_TEST.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in doc["tests"]:
        for case in test["alert_rule_test"]:
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert alerts - firing == set(), "never tested firing"
    assert alerts - quiet == set(), "never tested not firing"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # A former leader's stale follower-lag gauge would count.
        ("            and on (instance) (roadlog_raft_role == 3)\n", ""),
        # A stopped node (no roadlog_ready at all) would go unnoticed.
        ('up{job="roadlog-node"} == 0 or roadlog_ready', "roadlog_ready"),
        # A heat map an hour old would count as fresh.
        (
            "roadlog_heatmap_last_computed_seconds) > 1200",
            "roadlog_heatmap_last_computed_seconds) > 3600",
        ),
        # No pending period.
        ("        for: 1m\n", "        for: 0s\n"),
        # A stall measured in seconds, not triggers: a stream with 5-minute
        # triggers would be stalled between every two.
        (
            '> 4 * roadlog_heatmap_stream_trigger_interval_seconds{job="roadlog-heatmap-stream"}',
            "> 240",
        ),
        # Three intervals: the third trigger since would not have had a whole one.
        ("> 4 * roadlog_heatmap_stream", "> 3 * roadlog_heatmap_stream"),
        # A stream whose process is down would go unnoticed (its series vanish).
        ('\n          or up{job="roadlog-heatmap-stream"} == 0', ""),
    ],
    ids=[
        "stale-lag",
        "node-down",
        "heatmap-age",
        "for",
        "stream-seconds",
        "stream-3",
        "stream-down",
    ],
)
def test_the_rule_tests_catch_a_broken_rule(tmp_path: Path, old: str, new: str) -> None:
    text = RULES.read_text()
    assert old in text
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    r = run_promtool("test", "rules", RULES_TEST.name, cwd=tmp_path)
    assert r.returncode != 0, "the broken rule passed its tests"


# ----------------------------------------------------- the role's config


def ansible_bool(value: object) -> bool:
    """Ansible's ``bool`` filter (the role's templates use it)."""
    if isinstance(value, str):
        return value.strip().lower() in ("yes", "on", "1", "true", "y", "t")
    return bool(value)


def render_config(
    tmp_path: Path,
    play_vars: dict[str, object] | None = None,
    master_vars: dict[str, object] | None = None,
) -> Path:
    """The role's prometheus.yml for an inventory of three nodes and two
    queue servers, one with its own metrics port, and lab1 the Spark master
    (with ``master_vars`` as its host variables; ``play_vars`` for every
    host); the rules beside it."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["bool"] = ansible_bool
    template = env.from_string((ROLE / "templates" / "prometheus.yml.j2").read_text())
    hostvars: dict[str, dict[str, object]] = {
        f"lab{i}": {"ansible_host": f"10.77.0.1{i}"} | (play_vars or {}) for i in (1, 2, 3)
    }
    hostvars["lab2"]["roadlog_queue_metrics_port"] = 9501
    hostvars["lab1"].update(master_vars or {})
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    out = template.render(
        {k: v for k, v in defaults.items() if "{{" not in str(v)}
        | {
            "ansible_managed": "Ansible managed",
            "hostvars": hostvars,
            "roadlog_common_cluster_name": "lab",
            "roadlog_node_metrics_port": 9400,
            "roadlog_queue_metrics_port": 9500,
            "roadlog_monitoring_node_hosts": ["lab1", "lab2", "lab3"],
            "roadlog_monitoring_queue_hosts": ["lab1", "lab2"],
            "roadlog_monitoring_stream_hosts": ["lab1"],
            "roadlog_monitoring_alertmanagers": ["10.77.0.20:9093"],
            "roadlog_monitoring_config_dir": str(tmp_path),
            "roadlog_monitoring_ca_file": str(tmp_path / "roadlog-ca.crt"),
            "roadlog_monitoring_metrics_auth": "none",
            "roadlog_monitoring_token_file": str(tmp_path / "roadlog-metrics-token"),
            "roadlog_monitoring_client_cert_file": str(tmp_path / "roadlog-client.crt"),
            "roadlog_monitoring_client_key_file": str(tmp_path / "roadlog-client.key"),
        }
        | (play_vars or {})
    )
    for name in (
        "roadlog-ca.crt",
        "roadlog-metrics-token",
        "roadlog-client.crt",
        "roadlog-client.key",
    ):
        (tmp_path / name).write_text("")  # promtool checks only that they are there
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / "prometheus.yml").write_text(out)
    return tmp_path / "prometheus.yml"


def test_the_role_s_config_scrapes_the_inventory_under_the_rules_job_names(tmp_path: Path) -> None:
    config = render_config(tmp_path)
    r = run_promtool("check", "config", str(config), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = yaml.safe_load(config.read_text())
    targets = {
        job["job_name"]: sorted(t for sc in job["static_configs"] for t in sc["targets"])
        for job in doc["scrape_configs"]
    }
    assert targets["roadlog-node"] == ["10.77.0.11:9400", "10.77.0.12:9400", "10.77.0.13:9400"]
    assert targets["roadlog-queue"] == ["10.77.0.11:9500", "10.77.0.12:9501"]
    assert targets[STREAM_JOB] == []  # the cron job by default: no stream to scrape
    jobs_in_rules = set(re.findall(r'job="([^"]+)"', RULES.read_text()))
    jobs_in_dashboard = set(re.findall(r'job=~?"([^"]+)"', DASHBOARD.read_text()))
    jobs_in_dashboard = {j for alt in jobs_in_dashboard for j in alt.split("|")}
    assert jobs_in_rules | jobs_in_dashboard <= set(targets)
    assert doc["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "10.77.0.20:9093"
    ]


def test_each_target_is_the_address_its_metrics_port_binds(tmp_path: Path) -> None:
    """The roles bind a metrics port to the host's ansible_host (finding 15);
    a host whose inventory binds it elsewhere (roadlog_node_metrics_host,
    roadlog_queue_metrics_host) is scraped there, and one that binds every
    address ("") at its ansible_host."""
    config = render_config(
        tmp_path,
        master_vars={
            "roadlog_node_metrics_host": "192.168.40.11",
            "roadlog_queue_metrics_host": "",
        },
    )
    doc = yaml.safe_load(config.read_text())
    targets = {
        job["job_name"]: sorted(t for sc in job["static_configs"] for t in sc["targets"])
        for job in doc["scrape_configs"]
    }
    assert targets["roadlog-node"] == ["10.77.0.12:9400", "10.77.0.13:9400", "192.168.40.11:9400"]
    assert targets["roadlog-queue"] == ["10.77.0.11:9500", "10.77.0.12:9501"]


def test_the_role_scrapes_over_https_with_the_ca_where_the_daemons_run_tls(tmp_path: Path) -> None:
    """Issue 19: a node's and a queue server's metrics port is HTTPS when it
    runs with TLS, as the roles deploy it by default; a daemon run
    --insecure (debugging) is scraped in plaintext, each job on its own."""

    def jobs(play_vars: dict[str, object], where: Path) -> dict[str, dict[str, Any]]:
        where.mkdir()
        config = render_config(where, play_vars)
        r = run_promtool("check", "config", str(config), cwd=where)
        assert r.returncode == 0, r.stdout + r.stderr
        doc = yaml.safe_load(config.read_text())
        return {j["job_name"]: j for j in doc["scrape_configs"]}

    default = jobs({}, tmp_path / "default")
    ca = str(tmp_path / "default" / "roadlog-ca.crt")
    for name in ("roadlog-node", "roadlog-queue"):
        assert default[name]["scheme"] == "https"
        assert default[name]["tls_config"] == {"ca_file": ca}
    assert default[STREAM_JOB].get("scheme", "http") == "http"  # the stream has no certificate
    off: dict[str, object] = {"roadlog_node_insecure": True, "roadlog_queue_insecure": True}
    plain = jobs(off, tmp_path / "insecure")
    for name in ("roadlog-node", "roadlog-queue"):
        assert plain[name].get("scheme", "http") == "http" and "tls_config" not in plain[name]
    nodes_only = jobs({"roadlog_queue_insecure": True}, tmp_path / "nodes")
    assert nodes_only["roadlog-node"]["scheme"] == "https"
    assert nodes_only["roadlog-queue"].get("scheme", "http") == "http"


def test_the_role_scrapes_with_the_token_or_the_certificate_metrics_auth_asks(
    tmp_path: Path,
) -> None:
    """Issue 39: with metrics_auth token the node and queue jobs send the
    bearer token from its file; with tls they show Prometheus's client
    certificate; with none (the default) neither, as before."""

    def jobs(auth: str, play_vars: dict[str, object] | None = None) -> dict[str, dict[str, Any]]:
        where = tmp_path / f"{auth}-{len(play_vars or {})}"
        where.mkdir()
        config = render_config(where, {"roadlog_monitoring_metrics_auth": auth} | (play_vars or {}))
        r = run_promtool("check", "config", str(config), cwd=where)
        assert r.returncode == 0, r.stdout + r.stderr
        return {j["job_name"]: j for j in yaml.safe_load(config.read_text())["scrape_configs"]}

    for name, job in jobs("none").items():
        assert "authorization" not in job and "cert_file" not in job.get("tls_config", {}), name
    token = jobs("token")
    for name in ("roadlog-node", "roadlog-queue"):
        assert token[name]["authorization"] == {
            "type": "Bearer",
            "credentials_file": str(tmp_path / "token-0" / "roadlog-metrics-token"),
        }
        assert "cert_file" not in token[name]["tls_config"]
    assert "authorization" not in token[STREAM_JOB]
    plain = jobs("token", {"roadlog_node_insecure": True})
    assert "authorization" in plain["roadlog-node"] and "tls_config" not in plain["roadlog-node"]
    tls = jobs("tls")
    for name in ("roadlog-node", "roadlog-queue"):
        where = tmp_path / "tls-0"
        assert tls[name]["tls_config"] == {
            "ca_file": str(where / "roadlog-ca.crt"),
            "cert_file": str(where / "roadlog-client.crt"),
            "key_file": str(where / "roadlog-client.key"),
        }
        assert "authorization" not in tls[name]


def stream_targets(config: Path) -> list[tuple[list[str], dict[str, str]]]:
    r = run_promtool("check", "config", str(config), cwd=config.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = yaml.safe_load(config.read_text())
    [job] = [j for j in doc["scrape_configs"] if j["job_name"] == STREAM_JOB]
    assert job["honor_labels"] is True  # the series' own topic label, not exported_topic
    return [(sc["targets"], sc["labels"]) for sc in job["static_configs"]]


def test_in_stream_mode_the_role_scrapes_each_topic_s_stream(tmp_path: Path) -> None:
    stream = {
        "roadlog_heatmap_cron_mode": "stream",
        "roadlog_heatmap_cron_topics": ["munich", "vienna"],
        "roadlog_heatmap_cron_stream_metrics_port": 9450,
    }
    # As the heat-map role's unit gives them: the first topic's port, the next one's next.
    expected = [
        (["10.77.0.11:9450"], {"host": "lab1", "topic": "munich"}),
        (["10.77.0.11:9451"], {"host": "lab1", "topic": "vienna"}),
    ]
    assert stream_targets(render_config(tmp_path, play_vars=stream)) == expected
    # Set for the Spark master alone in the inventory: the same.
    assert stream_targets(render_config(tmp_path, master_vars=stream)) == expected
    # Another first port; the role's default (9450) when the inventory sets none.
    other = stream | {"roadlog_heatmap_cron_stream_metrics_port": 9600}
    assert [t for t, _ in stream_targets(render_config(tmp_path, play_vars=other))] == [
        ["10.77.0.11:9600"],
        ["10.77.0.11:9601"],
    ]
    del other["roadlog_heatmap_cron_stream_metrics_port"]
    assert stream_targets(render_config(tmp_path, play_vars=other)) == expected
    # No metrics port (0), the cron mode, or no topics: nothing to scrape.
    for off in (
        stream | {"roadlog_heatmap_cron_stream_metrics_port": 0},
        stream | {"roadlog_heatmap_cron_mode": "cron"},
        stream | {"roadlog_heatmap_cron_topics": []},
    ):
        assert stream_targets(render_config(tmp_path, play_vars=off)) == []


def test_the_role_s_stream_ports_are_the_heat_map_role_s() -> None:
    """The monitoring role falls back on the heat-map role's defaults, and
    its unit serves topic number i at the first port plus i."""
    heatmap_role = ROOT / "roles" / "roadlog_heatmap_cron"
    defaults = yaml.safe_load((heatmap_role / "defaults" / "main.yml").read_text())
    config = (ROLE / "templates" / "prometheus.yml.j2").read_text()
    assert f"default({defaults['roadlog_heatmap_cron_stream_metrics_port']})" in config
    assert f"default('{defaults['roadlog_heatmap_cron_mode']}')" in config
    unit = (heatmap_role / "templates" / "roadlog-heatmap-stream.service.j2").read_text()
    assert "roadlog_heatmap_cron_stream_metrics_port + index" in unit
    assert "_port + loop.index0" in config


# ------------------------------------------------------- the new metrics


def test_roadlog_ready_follows_readiness_at_each_scrape() -> None:
    state = {"ok": False}
    server = serve_metrics_and_health("127.0.0.1", 0, lambda: (state["ok"], {}))
    try:

        def scrape() -> str:
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                return str(r.read().decode())

        assert "\nroadlog_ready 0.0\n" in scrape()
        state["ok"] = True
        assert "\nroadlog_ready 1.0\n" in scrape()
    finally:
        server.shutdown()
        server.server_close()


def test_the_queue_server_times_answers_by_method_and_outcome(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)

    def count(outcome: str) -> float:
        labels = {"method": "Publish", "outcome": outcome}
        return REGISTRY.get_sample_value("roadlog_queue_answer_seconds_count", labels) or 0.0

    async def main() -> None:
        qs = QueueServer(QueueConfig(secret_file=secret))
        qs.q.connect(1, 1)
        qs.q.grant(1, 1000, 0)
        qs.q.update(1, True, 1, 0)
        ok_before, error_before = count("ok"), count("error")
        call = asyncio.create_task(qs.call("Publish", b"x", 30.0, "c"))
        for _ in range(100):  # until the call is queued (no clock involved)
            if qs._futures:
                break
            await asyncio.sleep(0)
        [item_id] = qs._futures
        qs._result(1, work_pb2.WorkResult(id=item_id, response=b"acked"))
        assert await call == b"acked"
        assert (count("ok"), count("error")) == (ok_before + 1, error_before)
        with pytest.raises(RoadlogError):
            await qs.call("Publish", b"x" * (CLIENT_MESSAGE_BYTES + 1), 30.0, "c")
        assert (count("ok"), count("error")) == (ok_before + 1, error_before + 1)

    asyncio.run(main())


def test_the_state_collector_exports_ingest_group_lag_and_heat_map_age(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "sm")
    collector = StateCollector()

    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in collector.collect()
            for s in family.samples
        }

    assert samples() == {}  # watching nothing yet
    collector.watch(c.sm)
    identities: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {
        (name, (("kind", kind),)): value
        for kind, cap in (("admin", 10_000), ("registered", 1_000_000))
        for name, value in (
            ("roadlog_identities", 0),
            ("roadlog_identities_cap", cap),
            ("roadlog_identity_cap_fill_ratio", 0),
        )
    }
    assert samples() == {
        ("roadlog_topic_appended_pings_total", (("topic", "munich"),)): 0,
        ("roadlog_topic_kept_pings", (("topic", "munich"),)): 0,
        ("roadlog_identities_forgotten_total", ()): 0,
        **identities,
    }
    c.publish("alice", T0, n=10)
    member = c.join("m1")
    desc = c.sm.describe("munich")
    ends = {p.partition: p.next_offset for p in desc.partitions}
    read = {p: n for p, n in ends.items() if n}  # everything read and committed ...
    p0 = min(read)
    read[p0] -= 1  # ... but one ping of one partition
    assert c.commit("m1", member.generation, read).code == 0
    c.publish("alice", T0 + 1000, n=5)  # and five more not read
    hm = heatmaps_pb2.HeatMap(
        topic="munich",
        window_start_ms=T0,
        window_end_ms=T0 + 900_000,
        h3_resolution=9,
        computed_ms=T0 + 960_000,
        cells=heatmaps_pb2.HeatMapCells(
            h3=[617700169958293503], pings=[3], devices=[3], mean_speed_mps=[7.5]
        ),
    )
    c.ok(
        command_pb2.Op(
            put_heatmap=command_pb2.PutHeatmapOp(request=client_pb2.PutHeatmapRequest(heatmap=hm))
        )
    )
    got = samples()
    topic = (("topic", "munich"),)
    assert got[("roadlog_topic_appended_pings_total", topic)] == 15
    assert got[("roadlog_topic_kept_pings", topic)] == 15
    assert got[("roadlog_group_lag_pings", (("group", "dash"), ("topic", "munich")))] == 1 + 5
    assert got[("roadlog_heatmap_last_computed_seconds", topic)] == (T0 + 960_000) / 1000
    assert got[("roadlog_heatmap_last_window_end_seconds", topic)] == (T0 + 900_000) / 1000
    c.sm.close()
    assert samples() == {}  # unreadable state: the scrape still answers, without them
