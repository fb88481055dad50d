"""Each process tells its release (issue 42): the version and, where known,
the commit (``roadlog/COMMIT`` written at build time, else the git checkout
the code runs from); ``--version`` on the three entry points; a mixed
cluster is named as such in ``cluster status``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from roadlog import __version__
from roadlog.cli.cluster import mixed_releases
from roadlog.release import commit_of, mixed, release

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def test_the_release_is_the_version_and_the_checkouts_commit() -> None:
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert release() == f"{__version__}+g{head[:12]}"


def test_a_built_package_reads_its_commit_file_and_an_exported_tree_has_none(
    tmp_path: Path,
) -> None:
    package = tmp_path / "site-packages" / "roadlog"  # no git checkout around it
    package.mkdir(parents=True)
    assert commit_of(package) == ""
    (package / "COMMIT").write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert commit_of(package) == "0123456789ab"
    (package / "COMMIT").write_text("not a commit\n")
    assert commit_of(package) == ""


@pytest.mark.parametrize(
    "module,prog",
    [("roadlog.cli", "roadlog"), ("node_daemon.process.main", "roadlog-node"),
     ("queue_server.main", "roadlog-queue")],
)  # fmt: skip
def test_each_entry_point_tells_its_release(module: str, prog: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True, text=True, check=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert out.stdout == f"{prog} {release()}\n"


def test_cluster_status_names_a_mixed_cluster_with_who_runs_what() -> None:
    assert mixed(["a", "a"]) == [] and mixed(["b", "", "b"]) == ["", "b"]
    status = {
        "nodes": [
            {"id": 1, "role": "leader", "version": "0.2.0+gb"},
            {"id": 2, "role": "follower", "version": ""},  # an older release tells none
            {"id": 3, "role": "down"},  # not asked: not counted
        ],
        "queue_servers": [
            {"grpc": "q:1", "up": True, "version": "0.2.0+gb"},
            {"grpc": "q:2", "up": False},
        ],
    }
    assert mixed_releases(status) == {"": ["n2"], "0.2.0+gb": ["n1", "q:1"]}
    status["nodes"][1]["version"] = "0.2.0+gb"
    assert mixed_releases(status) == {}


def test_the_wheel_carries_the_commit_the_wheelhouse_writes() -> None:
    # scripts/build_wheelhouse.sh writes roadlog/COMMIT, the package data
    # takes it into the wheel, and the tree never keeps it.
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'roadlog = ["COMMIT"]' in pyproject
    script = (REPO / "scripts" / "build_wheelhouse.sh").read_text()
    assert "> roadlog/COMMIT" in script and "roadlog/COMMIT' EXIT" in script
    assert "/roadlog/COMMIT" in (REPO / ".gitignore").read_text().splitlines()
