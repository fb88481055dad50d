"""Reading pings from files: CSV, GPX and GeoJSON points, in chunks."""

from __future__ import annotations

import csv
import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from roadlog.columnar import PingColumns

CSV_HEADER = ["device_id", "ts_ms", "lat", "lon", "speed_mps", "heading_deg"]


class InputError(ValueError):
    """The file cannot be read as pings; the message says where and why."""


def read_pings(path: Path, chunk: int = 50_000) -> Iterator[PingColumns]:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        yield from _csv(path, chunk)
    elif suffix == ".gpx":
        yield from _chunks(_gpx(path), chunk)
    elif suffix in (".geojson", ".json"):
        yield from _chunks(_geojson(path), chunk)
    else:
        raise InputError(f"{path}: unknown format (want .csv, .gpx or .geojson)")


Row = tuple[str, int, float, float, float, float, float]


def _chunks(rows: Iterator[Row], chunk: int) -> Iterator[PingColumns]:
    buf: list[Row] = []
    for r in rows:
        buf.append(r)
        if len(buf) >= chunk:
            yield _cols(buf)
            buf = []
    if buf:
        yield _cols(buf)


def _cols(rows: list[Row]) -> PingColumns:
    dev, ts, lat, lon, sp, hd, ac = zip(*rows, strict=True)
    return PingColumns.from_columns(list(dev), ts, lat, lon, sp, hd, ac)


def _num(v: str | None) -> float:
    return float(v) if v not in (None, "") else math.nan


def _csv(path: Path, chunk: int) -> Iterator[PingColumns]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in CSV_HEADER[:4] if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(
                f"{path}: CSV header lacks {', '.join(missing)} (want {','.join(CSV_HEADER)})"
            )

        def rows() -> Iterator[Row]:
            for line, r in enumerate(reader, start=2):
                try:
                    yield (
                        r["device_id"],
                        int(r["ts_ms"]),
                        float(r["lat"]),
                        float(r["lon"]),
                        _num(r.get("speed_mps")),
                        _num(r.get("heading_deg")),
                        _num(r.get("accuracy_m")),
                    )
                except (TypeError, ValueError) as e:
                    raise InputError(f"{path}:{line}: {e}") from None

        yield from _chunks(rows(), chunk)


def _gpx(path: Path) -> Iterator[Row]:
    device = path.stem
    try:
        for _, el in ET.iterparse(path, events=("end",)):
            tag = el.tag.rsplit("}", 1)[-1]
            if tag == "name" and device == path.stem and el.text:
                device = el.text.strip()[:64] or device
            if tag != "trkpt":
                continue
            t = next((c.text for c in el if c.tag.rsplit("}", 1)[-1] == "time"), None)
            if t is None:
                raise InputError(f"{path}: a trkpt has no <time>")
            ts = int(datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp() * 1000)
            speed = next((c.text for c in el.iter() if c.tag.rsplit("}", 1)[-1] == "speed"), None)
            yield (
                device,
                ts,
                float(el.attrib["lat"]),
                float(el.attrib["lon"]),
                _num(speed),
                math.nan,
                math.nan,
            )
            el.clear()
    except ET.ParseError as e:
        raise InputError(f"{path}: not GPX: {e}") from None


def _geojson(path: Path) -> Iterator[Row]:
    try:
        doc: Any = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not JSON: {e}") from None
    feats = doc.get("features", []) if isinstance(doc, dict) else []
    for i, f in enumerate(feats):
        geom, props = f.get("geometry") or {}, f.get("properties") or {}
        if geom.get("type") != "Point":
            raise InputError(f"{path}: feature {i} is not a Point")
        lon, lat = geom["coordinates"][:2]
        ts = props.get("ts_ms")
        if ts is None and "time" in props:
            ts = int(
                datetime.fromisoformat(str(props["time"]).replace("Z", "+00:00")).timestamp() * 1000
            )
        if ts is None:
            raise InputError(f"{path}: feature {i} has no ts_ms or time property")
        yield (
            str(props.get("device_id", path.stem)),
            int(ts),
            float(lat),
            float(lon),
            float(props.get("speed_mps", math.nan)),
            float(props.get("heading_deg", math.nan)),
            float(props.get("accuracy_m", math.nan)),
        )
