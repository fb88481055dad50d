"""``roadlog_build_info{version}``: 1, labelled with the process's release
(``roadlog.release``), on the metrics of every node and queue server (one
gauge, declared once, that both daemons' metrics modules export), so a
dashboard or an alert sees a mixed cluster mid rolling upgrade
(``count(count by (version) (roadlog_build_info)) > 1``)."""

from __future__ import annotations

from prometheus_client import Gauge

from roadlog.release import release

BUILD_INFO = Gauge(
    "roadlog_build_info",
    "1, labelled with the release this process runs (version+gcommit where known)",
    ["version"],
)
BUILD_INFO.labels(release()).set(1)

__all__ = ["BUILD_INFO"]
