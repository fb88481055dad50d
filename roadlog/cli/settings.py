"""``roadlog cluster settings``: the cluster's settings in its replicated
state (issue 39), read and set with the scope admin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from roadlog.cli.cluster import cluster
from roadlog.cli.common import connection, err, out, where
from roadlog.client import Admin
from roadlog.v1 import settings_pb2


@cluster.group("settings")
def settings() -> None:
    """The cluster's settings (admin): what self-registered phones get, and more."""


def _doc(s: settings_pb2.ClusterSetting) -> dict[str, Any]:
    return {"key": s.key, "value": s.value, "default": s.default, "set": s.set, "help": s.help}


@settings.command("get")
@click.argument("key", required=False, default="")
@where
@click.option("--json", "as_json", is_flag=True)
def settings_get(key: str, cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """Every setting with its value and default, or KEY's."""
    with connection(cluster, servers) as conn:
        found = Admin(conn).settings(key)
    if as_json:
        docs = [_doc(s) for s in found]
        click.echo(json.dumps(docs[0] if key else docs, indent=2))
        return
    t = Table()
    for col in ("key", "value", "default", "what"):
        t.add_column(col)
    for s in found:
        t.add_row(s.key, s.value + ("" if s.set else " (default)"), s.default, s.help)
    out.print(t)


@settings.command("set")
@click.argument("key")
@click.argument("value")
@where
@click.option("--json", "as_json", is_flag=True)
def settings_set(
    key: str, value: str, cluster: Path | None, servers: str | None, as_json: bool
) -> None:
    """Set KEY to VALUE for the whole cluster (checked by the cluster)."""
    with connection(cluster, servers) as conn:
        s = Admin(conn).set_setting(key, value)
        fence = conn.fence
    if as_json:
        click.echo(json.dumps({**_doc(s), "applied_index": fence}, indent=2))
    else:
        err.print(f"{s.key} = {s.value}")
