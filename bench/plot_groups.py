"""The scaling curve of issue 18: ingest pings/s against data groups, from
``bench/results/ingest-groups-G.json`` (``bench/ingest.py --groups G``; G = 1:
the same command without ``--groups``, its file copied under that name),
one line per message size for roadlog and JetStream's figure of the same
run beside it. Writes ``bench/results/ingest-groups.png``.

    python -m bench.plot_groups
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.common import RESULTS

_FILE = re.compile(r"ingest-groups-(\d+)\.json$")


def curve(results: Path, pings: int) -> list[tuple[int, float, float | None]]:
    """(groups, roadlog pings/s, JetStream pings/s in the same run) for each
    ``ingest-groups-G.json`` in ``results`` with a case of ``pings`` pings per
    message, by groups."""
    out = []
    for f in results.glob("ingest-groups-*.json"):
        m = _FILE.search(f.name)
        if not m:
            continue  # ingest-groups-G-workers-W and the like: another setup
        cases = json.loads(f.read_text())["cases"]
        ours = [c for c in cases if c["system"] == "roadlog" and c["pings_per_message"] == pings]
        theirs = [
            c for c in cases if c["system"] == "jetstream" and c["pings_per_message"] == pings
        ]
        if ours:
            js = theirs[0]["pings_per_s"] if theirs else None
            out.append((int(m[1]), ours[0]["pings_per_s"], js))
    return sorted(out)


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for pings, color in ((100, "tab:blue"), (1000, "tab:orange")):
        pts = curve(RESULTS, pings)
        if not pts:
            continue
        gs = [g for g, _, _ in pts]
        ax.plot(gs, [r / 1e6 for _, r, _ in pts], "o-", color=color, label=f"roadlog, {pings}/msg")
        js = [(g, j) for g, _, j in pts if j is not None]
        ax.plot([g for g, _ in js], [j / 1e6 for _, j in js], "x--", color=color,
                label=f"JetStream (same runs), {pings}/msg")  # fmt: skip
    ax.set_xlabel("data groups (3 nodes)")
    ax.set_ylabel("M pings/s")
    ax.set_title("Ingest against data groups, 2 cores")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = RESULTS / "ingest-groups.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
