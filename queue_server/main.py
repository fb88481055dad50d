"""``roadlog-queue run --config FILE``: the queue server process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from queue_server.config import load_queue_config
from queue_server.server import serve
from roadlog.runtime import eventloop
from roadlog.runtime.config import ConfigError
from roadlog.runtime.logs import setup_logging


@click.group()
def cli() -> None:
    """The roadlog queue server."""


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML file")
@click.option("--cluster-name")
@click.option("--listen", help="HOST:PORT of the gRPC API (clients and nodes)")
@click.option("--advertise-address")
@click.option("--http-listen", help="HOST:PORT of the HTTP/JSON API")
@click.option("--secret-file", type=click.Path(path_type=Path))
@click.option("--metrics-port", type=int)
@click.option("--max-writes", type=int)
@click.option("--max-reads", type=int)
@click.option("--default-timeout-ms", type=int)
@click.option("--discovery-port", type=int, help="announce to nodes on this UDP port (0: no)")
@click.option("--discovery-broadcast", help="where announcements are broadcast")
@click.option("--discovery-seeds", help="HOST:PORT,... to announce to by unicast")
@click.option("--log-level")
def run(config_path: Path | None, **flags: Any) -> None:
    """Run a queue server until SIGTERM."""
    try:
        cfg = load_queue_config(config_path, flags)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    setup_logging("queue", cfg.log_level)
    try:
        eventloop.run(serve(cfg))
    except RuntimeError as e:
        print(f"roadlog-queue: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
