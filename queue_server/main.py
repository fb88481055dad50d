"""``roadlog-queue run --config FILE``: the queue server process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from queue_server.config import QueueConfig, load_queue_config
from queue_server.serve import serve
from roadlog.release import version_option
from roadlog.runtime import eventloop, tls
from roadlog.runtime.config import (
    ConfigError,
    check_secret,
    config_flags,
    private_files,
    refuse_to_start,
)
from roadlog.runtime.health import metrics_auth
from roadlog.runtime.logs import setup_logging


@click.group()
@version_option("roadlog-queue")
def cli() -> None:
    """The roadlog queue server."""
    private_files()


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML file")
@config_flags(QueueConfig)
def run(config_path: Path | None, **flags: Any) -> None:
    """Run a queue server until SIGTERM."""
    try:
        cfg = load_queue_config(config_path, flags)
        check_secret(cfg.secret_file)
        metrics_auth(cfg.metrics_auth, cfg.metrics_token_file, cfg.insecure)  # refused here
        security = tls.load_security(cfg.certs_dir, cfg.insecure, "queue")
    except ConfigError as e:
        refuse_to_start("roadlog-queue", e)
    tls.install(security)
    setup_logging("queue", cfg.log_level)
    if security.insecure:
        tls.warn_insecure("roadlog-queue")
    try:
        eventloop.run(serve(cfg))
    except RuntimeError as e:
        print(f"roadlog-queue: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
