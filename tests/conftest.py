"""Test-wide settings. In CI, property tests run derandomized (the same
examples every run) so that a landing never depends on a lucky draw; locally
they explore new examples each run."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
