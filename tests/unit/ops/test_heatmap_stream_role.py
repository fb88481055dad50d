"""The Ansible role's choice between the cron job and the streaming heat
map: every variable documented, and the stream's unit and script render to
a command line the stream job accepts."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from spark.jobs.heatmap_stream import parser

pytestmark = pytest.mark.unit

ROLE = Path(__file__).resolve().parents[3] / "roles" / "roadlog_heatmap_cron"


def render(name: str, extra: dict[str, Any]) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(ROLE / "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,  # as Ansible's template module renders
    )
    env.filters["quote"] = shlex.quote
    env.filters["bool"] = lambda v: (
        v if isinstance(v, bool) else str(v).lower() in ("true", "yes", "1")
    )
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    context = (
        {k: v for k, v in defaults.items() if "{{" not in str(v)}
        | {
            "ansible_managed": "Ansible managed",
            "roadlog_common_user": "roadlog",
            "roadlog_common_group": "roadlog",
            "roadlog_common_home": "/opt/roadlog",
            "roadlog_common_venv": "/opt/roadlog/venv",
            "roadlog_common_config_dir": "/etc/roadlog",
            "roadlog_common_cluster_name": "lab",
            "roadlog_heatmap_cron_dir": "/var/lib/roadlog/heatmap",
            "roadlog_heatmap_cron_master": "spark://10.77.0.11:7077",
            "roadlog_heatmap_cron_driver_host": "10.77.0.11",
            "roadlog_heatmap_cron_nodes": ["10.77.0.11:7400", "10.77.0.12:7400"],
            "roadlog_heatmap_cron_servers": ["10.77.0.11:7500"],
            "roadlog_heatmap_cron_env_archive": "/opt/roadlog/spark-env/roadlog-env.tar.gz",
            "roadlog_heatmap_cron_spark_home": "/opt/roadlog/venv/lib/pyspark",
            "roadlog_heatmap_cron_java_home": "/usr/lib/jvm/java-17-openjdk-amd64",
            "roadlog_common_certs_dir": "/etc/roadlog/certs",
            "roadlog_heatmap_cron_serve": True,
        }
        | extra
    )
    # The role's internal vars (vars/main.yml), each one expression over the rest.
    for k, v in yaml.safe_load((ROLE / "vars" / "main.yml").read_text()).items():
        expr = str(v).strip().removeprefix("{{").removesuffix("}}")
        context[k] = env.compile_expression(expr, undefined_to_none=False)(**context)
    return env.get_template(name).render(context)


def test_every_default_is_documented_and_the_mode_is_cron_or_stream() -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options)
    assert defaults["roadlog_heatmap_cron_mode"] == "cron"
    assert options["roadlog_heatmap_cron_mode"]["choices"] == ["cron", "stream"]


def test_the_stream_unit_runs_the_script_for_its_topic_with_its_metrics_port() -> None:
    unit = render("roadlog-heatmap-stream.service.j2", {"item": "munich", "index": 1})
    exec_start = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert exec_start == "ExecStart=/opt/roadlog/bin/roadlog-heatmap-stream munich 9451"
    assert "User=roadlog" in unit and "Restart=always" in unit
    assert "ReadWritePaths=/var/lib/roadlog/heatmap" in unit and "NoNewPrivileges=yes" in unit
    no_port = {"item": "munich", "index": 0, "roadlog_heatmap_cron_stream_metrics_port": 0}
    off = render("roadlog-heatmap-stream.service.j2", no_port)
    assert "roadlog-heatmap-stream munich 0\n" in off


def test_the_stream_script_passes_what_the_stream_job_accepts() -> None:
    script = render("roadlog-heatmap-stream.sh.j2", {})
    line = " ".join(x.rstrip("\\").strip() for x in script.split("spark/jobs/heatmap_stream.py")[-1]
                    .splitlines())  # fmt: skip
    words = shlex.split(line.replace('"$topic"', "munich").replace('"${metrics[@]}"', ""))
    words = [w.replace("$topic", "munich") for w in words]
    args = parser().parse_args(words)
    assert args.topic == "munich" and args.every_ms == 60_000 and args.window_ms == 900_000
    assert args.lateness_ms == 600_000 and args.history_ms == 86_400_000
    assert str(args.checkpoint) == "/var/lib/roadlog/heatmap/stream/munich"
    assert args.nodes == "10.77.0.11:7400,10.77.0.12:7400"


@pytest.mark.parametrize("script", ["roadlog-heatmap.sh.j2", "roadlog-heatmap-stream.sh.j2"])
def test_the_scripts_dial_with_the_ca_and_the_spark_client_certificate_here_and_in_executors(
    script: str,
) -> None:
    """Issue 19: the driver reads nodes (mutual TLS) with the Spark reader's
    client certificate; the executors get theirs from the Spark worker's unit
    (finding 13: they run as the Spark user), never through executorEnv
    (which also reaches the driver's planning worker); with TLS the job
    gets nothing derived from the cluster secret and submits with the Spark
    secret's properties file; plaintext only where TLS is off."""
    text = render(script, {})
    assert "export ROADLOG_CA_FILE=/etc/roadlog/certs/ca.crt" in text
    assert "export ROADLOG_CERT_FILE=/etc/roadlog/certs/client.spark.crt" in text
    assert "export ROADLOG_KEY_FILE=/etc/roadlog/certs/client.spark.key" in text
    assert "spark.executorEnv.ROADLOG_" not in text and "--secret-file" not in text
    assert "--properties-file /etc/roadlog/spark-job.conf" in text
    assert "ROADLOG_INSECURE" not in text
    off = render(script, {"roadlog_common_insecure": True})
    assert "export ROADLOG_INSECURE=1" in off and "ROADLOG_CA_FILE" not in off
    assert '--conf spark.executorEnv.ROADLOG_INSECURE="$ROADLOG_INSECURE"' in off
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    # One spark-submit command line: every line of it continued up to the job.
    submit = text[text.index('"$SPARK_HOME/bin/spark-submit"') : text.index("/spark/jobs/")]
    assert all(line.endswith("\\") for line in submit.splitlines()[:-1]), submit


def test_the_cron_job_asks_the_warm_server_first_and_builds_itself_when_it_does_not_answer() -> (
    None
):
    text = render("roadlog-heatmap.sh.j2", {})
    ask = text.index("-m spark.job_client")
    assert ask < text.index('"$SPARK_HOME/bin/spark-submit"')
    assert "--server 127.0.0.1:9460" in text and '[ "$served" != 75 ]' in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    off = render("roadlog-heatmap.sh.j2", {"roadlog_heatmap_cron_serve": False})
    assert "spark.job_client" not in off


def test_the_serve_unit_runs_a_command_line_heatmap_serve_accepts() -> None:
    from roadlog.cli.heatmap import heatmap_serve

    unit = render("roadlog-heatmap-serve.service.j2", {})
    assert "ExecStart=/opt/roadlog/bin/roadlog-heatmap-serve" in unit
    assert "User=roadlog" in unit and "Restart=always" in unit and "NoNewPrivileges=yes" in unit
    script = render("roadlog-heatmap-serve.sh.j2", {})
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "export ROADLOG_CA_FILE=/etc/roadlog/certs/ca.crt" in script
    assert "--properties-file /etc/roadlog/spark-job.conf" in script
    line = " ".join(x.rstrip("\\").strip() for x in script.split("roadlog heatmap serve")[-1]
                    .splitlines())  # fmt: skip
    ctx = heatmap_serve.make_context("serve", shlex.split(line))
    assert ctx.params["listen"] == "127.0.0.1:9460"
    assert ctx.params["master"] == "spark://10.77.0.11:7077"
    assert str(ctx.params["certs_dir"]) == "/etc/roadlog/certs"
    assert ctx.params["history"] == "86400s" and ctx.params["metrics_token_file"] is None
    with_token = render("roadlog-heatmap-serve.sh.j2", {"roadlog_common_metrics_auth": "token"})
    assert "--metrics-token-file /etc/roadlog/metrics_token" in with_token
