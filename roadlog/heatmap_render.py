"""Heat maps as things people look at: GeoJSON, a PNG (matplotlib) and a
self-contained HTML page that works offline (inline data, no tiles, no
scripts from anywhere else).

Colour is congestion (green flowing, red standing still); opacity grows
with the number of pings, so a busy jam stands out from a lone slow car.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import h3
import numpy as np

from roadlog.columnar import optional
from roadlog.v1 import heatmaps_pb2

CMAP = "RdYlGn_r"


def cells(hm: heatmaps_pb2.HeatMap) -> list[dict[str, Any]]:
    """One dict per cell: id, boundary ring (lon, lat), and the figures."""
    c = hm.cells
    n = len(c.h3)
    free = list(c.free_flow_mps) or [math.nan] * n
    cong = list(c.congestion) or [math.nan] * n
    out = []
    for i in range(n):
        cid = h3.int_to_str(int(c.h3[i]))
        ring = [(lng, lat) for lat, lng in h3.cell_to_boundary(cid)]
        out.append(
            {
                "h3": cid,
                "ring": ring,
                "pings": int(c.pings[i]),
                "devices": int(c.devices[i]),
                "mean_speed_mps": optional(c.mean_speed_mps[i], 3),
                "free_flow_mps": optional(free[i], 3),
                "congestion": optional(cong[i], 3),
            }
        )
    return out


def _window(hm: heatmaps_pb2.HeatMap) -> str:
    fmt = "%Y-%m-%d %H:%M"
    a = time.strftime(fmt, time.gmtime(hm.window_start_ms / 1000))
    b = time.strftime("%H:%M", time.gmtime(hm.window_end_ms / 1000))
    return f"{a}-{b} UTC"


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def geojson(hm: heatmaps_pb2.HeatMap) -> dict[str, Any]:
    feats = []
    for c in cells(hm):
        ring = [list(p) for p in c["ring"]] + [list(c["ring"][0])]
        props = {k: v for k, v in c.items() if k != "ring"}
        feats.append(
            {
                "type": "Feature",
                "geometry": {"type": "Polygon", "coordinates": [ring]},
                "properties": props,
            }
        )
    return {
        "type": "FeatureCollection",
        "properties": {
            "topic": hm.topic,
            "window_start_ms": hm.window_start_ms,
            "window_end_ms": hm.window_end_ms,
            "h3_resolution": hm.h3_resolution,
        },
        "features": feats,
    }


def write_geojson(hm: heatmaps_pb2.HeatMap, path: Path) -> None:
    _write(path, json.dumps(geojson(hm)).encode())


def _styles(cs: list[dict[str, Any]]) -> tuple[list[str], list[float]]:
    """Fill colour (hex) and opacity per cell."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps[CMAP]
    pings = np.array([c["pings"] for c in cs], dtype=float)
    top = float(np.percentile(pings, 95)) if len(pings) else 1.0
    colours = [to_hex(cmap(c["congestion"] if c["congestion"] is not None else 0.0)) for c in cs]
    alphas = [round(0.25 + 0.7 * min(1.0, p / max(top, 1.0)), 3) for p in pings]
    return colours, alphas


def write_png(hm: heatmaps_pb2.HeatMap, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import Normalize

    cs = cells(hm)
    colours, alphas = _styles(cs)
    fig, ax = plt.subplots(figsize=(10, 8), dpi=110)
    ax.set_facecolor("#f4f4f0")
    if len(hm.bbox) == 4:
        x0, y0, x1, y1 = hm.bbox
        ax.plot([x0, x1, x1, x0, x0], [y0, y0, y1, y1, y0], color="#888", lw=1, ls="--")
    polys = [c["ring"] for c in cs]
    rgba = [(*matplotlib.colors.to_rgb(col), a) for col, a in zip(colours, alphas, strict=True)]
    ax.add_collection(PolyCollection(polys, facecolors=rgba, edgecolors="none"))
    jam = sorted(
        (c for c in cs if c["congestion"] is not None),
        key=lambda c: (c["congestion"] or 0) * math.log1p(c["pings"]),
        reverse=True,
    )[:1]
    for c in jam:
        xs, ys = zip(*c["ring"], strict=True)
        ax.annotate(
            f"worst: {c['mean_speed_mps'] or 0:.1f} m/s over {c['pings']} pings",
            (sum(xs) / len(xs), sum(ys) / len(ys)),
            xytext=(20, 20),
            textcoords="offset points",
            arrowprops={"arrowstyle": "->", "color": "black"},
            fontsize=9,
            bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85},
        )
    if cs:
        allx = [x for p in polys for x, _ in p]
        ally = [y for p in polys for _, y in p]
        if len(hm.bbox) == 4:
            allx += [hm.bbox[0], hm.bbox[2]]
            ally += [hm.bbox[1], hm.bbox[3]]
        ax.set_xlim(min(allx), max(allx))
        ax.set_ylim(min(ally), max(ally))
        ax.set_aspect(1 / math.cos(math.radians((min(ally) + max(ally)) / 2)))
    sm = ScalarMappable(norm=Normalize(0, 1), cmap=CMAP)
    fig.colorbar(sm, ax=ax, shrink=0.7, label="congestion: 1 - mean speed / free-flow speed")
    ax.set_title(
        f"roadlog traffic - {hm.topic} - {_window(hm)}\n"
        f"{len(cs)} H3 cells (res {hm.h3_resolution}), {hm.source_pings:,} pings; "
        "opacity: pings per cell"
    )
    ax.set_xlabel("longitude")
    ax.set_ylabel("latitude")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    _write(path, buf.getvalue())


def write_html(hm: heatmaps_pb2.HeatMap, path: Path) -> None:
    cs = cells(hm)
    colours, alphas = _styles(cs)
    data = [
        {**{k: v for k, v in c.items()}, "fill": col, "alpha": a}
        for c, col, a in zip(cs, colours, alphas, strict=True)
    ]
    page = (
        _PAGE.replace("__TITLE__", html.escape(f"roadlog traffic - {hm.topic} - {_window(hm)}"))
        .replace(
            "__SUB__",
            html.escape(
                f"{len(cs)} H3 cells at resolution {hm.h3_resolution}, {hm.source_pings:,} pings"
            ),
        )
        .replace("__DATA__", json.dumps(data).replace("</", "<\\/"))
        .replace("__BBOX__", json.dumps(list(hm.bbox)))
    )
    _write(path, page.encode())


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 0; background: #f4f4f0; color: #222; }
header { padding: 10px 16px; background: #fff; border-bottom: 1px solid #ddd; }
h1 { font-size: 18px; margin: 0 0 4px; }
#wrap { position: relative; margin: 12px; }
canvas { background: #fbfbf8; border: 1px solid #ccc; width: 100%; height: auto; }
#tip { position: absolute; pointer-events: none; background: #fff; border: 1px solid #999;
       padding: 6px 8px; border-radius: 4px; font-size: 12px; display: none; }
#legend { display: flex; align-items: center; gap: 8px; margin: 0 12px 12px; }
#bar { width: 240px; height: 12px;
       background: linear-gradient(to right, #1a9850, #fee08b, #d73027); }
</style></head>
<body>
<header><h1>__TITLE__</h1><div>__SUB__. Colour: congestion (1 - mean speed / free-flow
speed); opacity: pings per cell. Hover a cell for its figures.</div></header>
<div id="wrap"><canvas id="map" width="1000" height="760"></canvas><div id="tip"></div></div>
<div id="legend"><span>flowing</span><div id="bar"></div><span>standing still</span></div>
<script>
"use strict";
const cells = __DATA__;
const bbox = __BBOX__;
const canvas = document.getElementById("map");
const ctx = canvas.getContext("2d");
let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
for (const c of cells) for (const [x, y] of c.ring) {
  x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
}
if (bbox.length === 4) {
  x0 = Math.min(x0, bbox[0]); y0 = Math.min(y0, bbox[1]);
  x1 = Math.max(x1, bbox[2]); y1 = Math.max(y1, bbox[3]);
}
const k = Math.cos(((y0 + y1) / 2) * Math.PI / 180);
const pad = 20;
const scale = Math.min((canvas.width - 2 * pad) / ((x1 - x0) * k || 1),
                       (canvas.height - 2 * pad) / ((y1 - y0) || 1));
const px = (x) => pad + (x - x0) * k * scale;
const py = (y) => canvas.height - pad - (y - y0) * scale;
function path(ring) {
  ctx.beginPath();
  ring.forEach(([x, y], i) => (i ? ctx.lineTo(px(x), py(y)) : ctx.moveTo(px(x), py(y))));
  ctx.closePath();
}
function draw(hover) {
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (bbox.length === 4) {
    ctx.setLineDash([6, 4]); ctx.strokeStyle = "#999";
    ctx.strokeRect(px(bbox[0]), py(bbox[3]), px(bbox[2]) - px(bbox[0]), py(bbox[1]) - py(bbox[3]));
    ctx.setLineDash([]);
  }
  for (const c of cells) {
    path(c.ring);
    ctx.globalAlpha = c.alpha; ctx.fillStyle = c.fill; ctx.fill();
    ctx.globalAlpha = 1;
    if (c === hover) { ctx.lineWidth = 2; ctx.strokeStyle = "#000"; ctx.stroke(); }
  }
}
function inside(ring, x, y) {
  let hit = false;
  for (let i = 0, j = ring.length - 1; i < ring.length; j = i++) {
    const [xi, yi] = ring[i], [xj, yj] = ring[j];
    if ((yi > y) !== (yj > y) && x < ((xj - xi) * (y - yi)) / (yj - yi) + xi) hit = !hit;
  }
  return hit;
}
const tip = document.getElementById("tip");
canvas.addEventListener("mousemove", (ev) => {
  const r = canvas.getBoundingClientRect();
  const cx = (ev.clientX - r.left) * (canvas.width / r.width);
  const cy = (ev.clientY - r.top) * (canvas.height / r.height);
  const x = x0 + (cx - pad) / (k * scale), y = y0 + (canvas.height - pad - cy) / scale;
  const c = cells.find((c) => inside(c.ring, x, y));
  draw(c);
  if (!c) { tip.style.display = "none"; return; }
  const f = (v, d) => (v === null ? "-" : v.toFixed(d));
  tip.innerHTML = "cell " + c.h3 + "<br>pings " + c.pings + ", devices " + c.devices +
    "<br>mean speed " + f(c.mean_speed_mps, 1) + " m/s, free-flow " + f(c.free_flow_mps, 1) +
    " m/s<br>congestion " + f(c.congestion, 2);
  tip.style.left = ev.clientX - r.left + 14 + "px"; tip.style.top = ev.clientY - r.top + 14 + "px";
  tip.style.display = "block";
});
draw(null);
document.body.dataset.cells = String(cells.length);
</script>
</body></html>
"""
