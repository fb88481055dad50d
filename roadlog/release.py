"""The release a process runs: ``roadlog.__version__`` and, where known, the
git commit it was built from (``0.1.0+g52326cf0a1b2``; PEP 440's local
version, as setuptools-scm spells it).

Where the commit comes from, first found wins:
- ``roadlog/COMMIT``: one line, the commit, written into the package by
  ``scripts/build_wheelhouse.sh`` just before it builds the wheel that
  the hosts install (and removed after, so a checkout never reads a stale
  one). A deployed host has no git checkout: this is how it knows.
- the git checkout the package is imported from (a developer's tree, the
  tests, ``roadlog cluster up``): ``git rev-parse HEAD``, once per process.
- neither (an exported tree, a wheel built otherwise): the version alone.

Every process tells it (``--version``, ``cluster status``'s ``version``,
``/metrics``' ``roadlog_build_info``, the peer link's greeting), so an
operator sees a mixed cluster mid rolling upgrade. Two releases are the
same exactly when these strings are equal.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from roadlog import __version__

COMMIT_FILE = Path(__file__).with_name("COMMIT")
COMMIT_DIGITS = 12

F = TypeVar("F", bound=Callable[..., Any])


def _git_commit(package: Path) -> str:
    """The commit of the git checkout ``package`` lies in ("" : none)."""
    root = package.parent
    if not (root / ".git").exists():  # a directory, or a worktree's file
        return ""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def commit_of(package: Path = COMMIT_FILE.parent) -> str:
    """The commit this code was built from, ``COMMIT_DIGITS`` long ("":
    unknown)."""
    try:
        commit = (package / COMMIT_FILE.name).read_text().strip()
    except OSError:
        commit = _git_commit(package)
    return commit[:COMMIT_DIGITS] if all(c in "0123456789abcdef" for c in commit) else ""


@functools.cache
def release() -> str:
    """This process's release: the version, ``+g`` and the commit where known."""
    commit = commit_of()
    return f"{__version__}+g{commit}" if commit else __version__


def mixed(releases: list[str]) -> list[str]:
    """The distinct releases of ``releases`` when there is more than one
    (a cluster mid-upgrade), sorted; [] when they agree. An empty string
    (a process of a release from before this field) counts as one."""
    distinct = sorted(set(releases))
    return distinct if len(distinct) > 1 else []


def version_option(prog: str) -> Callable[[F], F]:
    """``--version`` for a click group: prints ``PROG RELEASE`` and exits
    (the commit is looked up only when asked)."""

    def show(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if not value or ctx.resilient_parsing:
            return
        click.echo(f"{prog} {release()}")
        ctx.exit()

    return click.option(
        "--version",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=show,
        help="Show the release (version and commit) and exit.",
    )


__all__ = ["commit_of", "mixed", "release", "version_option"]
