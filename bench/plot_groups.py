"""The scaling curve of issue 18: ingest pings/s against data groups, from
``bench/results/ingest-groups-G.json`` (``bench/ingest.py --groups G``; G = 1:
the same command without ``--groups``, its file copied under that name),
one line per message size for roadlog and JetStream's figure of the same
run beside it; and the same curve at a load that grows with the groups
(``--concurrency`` 32 x G: ``ingest-groups-G-cN.json``), beside one group at
each of those loads (``ingest-c32G.json`` copied as ``ingest-groups-1-cN.json``):
whether a group's rounds, as full as one group's, cost more than its own
share. Writes ``bench/results/ingest-groups.png``.

    python -m bench.plot_groups
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.common import RESULTS

_FILE = re.compile(r"ingest-groups-(\d+)(?:-c(\d+))?\.json$")
STANDARD_PUBLISHERS = 32  # bench/ingest.py's default load


def _runs(results: Path) -> list[tuple[int, int, list[dict[str, Any]]]]:
    """(groups, publishers, cases) of each ``ingest-groups-G[-cN].json`` in
    ``results`` (without ``-cN``: the standard 32 publishers)."""
    out = []
    for f in results.glob("ingest-groups-*.json"):
        m = _FILE.search(f.name)
        if not m:
            continue  # ingest-groups-G-workers-W and the like: another setup
        publishers = int(m[2]) if m[2] else STANDARD_PUBLISHERS
        out.append((int(m[1]), publishers, json.loads(f.read_text())["cases"]))
    return out


def _pings_per_s(cases: list[dict[str, Any]], system: str, pings: int) -> float | None:
    """``system``'s pings/s at ``pings`` pings per message in a run's cases."""
    found = [c for c in cases if c["system"] == system and c["pings_per_message"] == pings]
    return found[0]["pings_per_s"] if found else None


def curve(
    results: Path, pings: int, per_group: int | None = None
) -> list[tuple[int, float, float | None]]:
    """(groups, roadlog pings/s, JetStream pings/s in the same run) for each
    ``ingest-groups-G.json`` in ``results`` with a case of ``pings`` pings per
    message, by groups. With ``per_group``: the runs whose publishers were
    ``per_group`` x G instead (``ingest-groups-G-cN.json``; the file without
    ``-cN`` had the standard 32)."""
    out = []
    for groups, publishers, cases in _runs(results):
        wanted = STANDARD_PUBLISHERS if per_group is None else per_group * groups
        ours = _pings_per_s(cases, "roadlog", pings)
        if publishers == wanted and ours is not None:
            out.append((groups, ours, _pings_per_s(cases, "jetstream", pings)))
    return sorted(out)


def one_group_at(results: Path, pings: int, per_group: int) -> list[tuple[int, float]]:
    """(G, one group's pings/s with ``per_group`` x G publishers) for each
    ``ingest-groups-1[-cN].json`` whose publishers are a multiple of
    ``per_group``: one group under the load the G-group point had."""
    out = []
    for groups, publishers, cases in _runs(results):
        ours = _pings_per_s(cases, "roadlog", pings)
        if groups == 1 and publishers % per_group == 0 and ours is not None:
            out.append((publishers // per_group, ours))
    return sorted(out)


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (fixed, grown) = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for pings, color in ((100, "tab:blue"), (1000, "tab:orange")):
        for ax, per_group in ((fixed, None), (grown, STANDARD_PUBLISHERS)):
            pts = curve(RESULTS, pings, per_group)
            if not pts:
                continue
            gs = [g for g, _, _ in pts]
            ax.plot(gs, [r / 1e6 for _, r, _ in pts], "o-", color=color,
                    label=f"roadlog, {pings}/msg")  # fmt: skip
            js = [(g, j) for g, _, j in pts if j is not None]
            ax.plot([g for g, _ in js], [j / 1e6 for _, j in js], "x--", color=color,
                    label=f"JetStream (same runs), {pings}/msg")  # fmt: skip
        single = one_group_at(RESULTS, pings, STANDARD_PUBLISHERS)
        if single:
            grown.plot([g for g, _ in single], [r / 1e6 for _, r in single], "s:", color=color,
                       label=f"roadlog, one group at that load, {pings}/msg")  # fmt: skip
    fixed.set_title(f"{STANDARD_PUBLISHERS} publishers in all")
    grown.set_title(f"{STANDARD_PUBLISHERS} publishers per group")
    fixed.set_ylabel("M pings/s")
    for ax in (fixed, grown):
        ax.set_xlabel("data groups (3 nodes)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Ingest against data groups, 2 cores")
    out = RESULTS / "ingest-groups.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
