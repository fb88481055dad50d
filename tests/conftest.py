"""Test-wide settings. In CI, property tests run derandomized (the same
examples every run) so that a landing never depends on a lucky draw; locally
they explore new examples each run."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import settings

from tests.certs import ClusterCA, make_test_ca

# No deadline: how long an example takes is a benchmark's business, not a
# test's (a loaded 2-core machine made examples "too slow" at random).
settings.register_profile("default", deadline=None)
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@contextmanager
def small_tmpfs(where: Path, size: str, why: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax, "2m") mounted at ``where`` for the
    block: a real full disk, not a simulated one. Needs root (``why`` says
    what for when it is missing); unmounted lazily whatever happens."""
    if os.geteuid() != 0:
        pytest.fail(f"{why} mounts a tmpfs and needs root (the suite runs as root)")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_up(path: Path) -> None:
    """Write zeros to ``path`` until its filesystem has no room left."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> ClusterCA:
    """The session's cluster CA and its certificates (tests/certs.py)."""
    return make_test_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="session")
def foreign_ca(tmp_path_factory: pytest.TempPathFactory) -> ClusterCA:
    """Another CA with certificates of the same names: refused everywhere."""
    return make_test_ca(tmp_path_factory.mktemp("foreign-ca"))


# The tiers run by marker (`-m integration tests/integration`, ...): a test
# in a tier's directory without that marker would be deselected, silently.
_TIERS = ("unit", "simulation", "integration", "netns", "lab")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    unmarked = []
    for item in items:
        try:
            tier = Path(str(item.path)).resolve().relative_to(tests).parts[0]
        except ValueError:
            continue
        if tier in _TIERS and item.get_closest_marker(tier) is None:
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) without their tier's marker, which `make test` would "
            f"never run: {', '.join(unmarked[:5])} (set pytestmark = pytest.mark.<tier>)"
        )
