"""An Ansible callback for the lab: how long each task of a playbook took,
summed over its hosts, written as JSON to ``$ROADLOG_ANSIBLE_TASK_TIMES``
when the playbook ends (tests/lab/conftest.py reads it into the lab's
timings). Wall-clock seconds from a task's start on a host to its result
there; the tasks Ansible skipped count too (a skip still costs a round)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ansible.plugins.callback import CallbackBase  # type: ignore[import-untyped]

DOCUMENTATION = """
    name: roadlog_task_times
    type: aggregate
    short_description: per-task seconds, summed over hosts, as JSON
    description: writes each task name with its seconds and hosts to $ROADLOG_ANSIBLE_TASK_TIMES
"""


class CallbackModule(CallbackBase):  # type: ignore[misc]
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "roadlog_task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._started: dict[tuple[str, str], float] = {}
        self._names: dict[str, str] = {}
        self._times: dict[str, list[float]] = {}

    def v2_runner_on_start(self, host: Any, task: Any) -> None:
        self._started[(task._uuid, host.get_name())] = time.monotonic()
        self._names[task._uuid] = task.get_name()

    def _ended(self, result: Any, *args: Any, **kwargs: Any) -> None:
        key = (result._task._uuid, result._host.get_name())
        t0 = self._started.pop(key, None)
        if t0 is None:
            return
        seconds, hosts = self._times.setdefault(self._names[key[0]], [0.0, 0])
        self._times[self._names[key[0]]] = [seconds + time.monotonic() - t0, int(hosts) + 1]

    v2_runner_on_ok = v2_runner_on_failed = v2_runner_on_skipped = _ended
    v2_runner_on_unreachable = _ended

    def v2_playbook_on_stats(self, stats: Any) -> None:
        path = os.environ.get("ROADLOG_ANSIBLE_TASK_TIMES")
        if path:
            with open(path, "w") as f:
                json.dump(self._times, f)
