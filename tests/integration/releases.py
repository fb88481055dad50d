"""An earlier release's tree, for the upgrade tests: a commit of this
repository exported with ``git archive`` (no checkout, no worktree), run
with this checkout's virtualenv."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def exported_release(commit: str, dest: Path, *, own_stubs: bool) -> Path:
    """``commit``'s files in ``dest``; the gRPC stubs generated from its own
    protos (``own_stubs``: a later release's could differ) or copied from
    this checkout. Skips the test if the commit is not in this checkout."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the baseline release {commit} is not in this checkout: {e}")
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    if not own_stubs:
        shutil.copytree(REPO / "roadlog" / "v1", dest / "roadlog" / "v1", dirs_exist_ok=True)
        return dest
    protos = sorted(str(p.relative_to(dest)) for p in (dest / "proto").glob("roadlog/v1/*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", "--python_out=.",
         "--grpc_python_out=.", *protos],
        cwd=dest, check=True, capture_output=True,
    )  # fmt: skip
    (dest / "roadlog" / "v1" / "__init__.py").touch()
    return dest
