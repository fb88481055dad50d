"""``roadlog``: the command line for clusters, topics, producing and consuming.

Every command finds the cluster by ``--cluster DIR`` (a local cluster made
by ``cluster up``), ``--servers HOST:PORT,...`` or ROADLOG_SERVERS. One
module a command group; ``common`` holds what they share.
"""

from __future__ import annotations

from roadlog.cli import ca, client, cluster, directory, heatmap, pings, settings, topic
from roadlog.cli.common import cli

__all__ = [
    "ca",
    "cli",
    "client",
    "cluster",
    "directory",
    "heatmap",
    "main",
    "pings",
    "settings",
    "topic",
]


def main() -> None:
    cli()
