"""Points to H3 cells, vectorised (h3ronpy, Rust, whole arrays at once)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from h3ronpy.vector import coordinates_to_cells


def cells_for(
    lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64], resolution: int
) -> npt.NDArray[np.uint64]:
    """The H3 cell (as its 64-bit index) of each (lat, lon) at ``resolution``."""
    if len(lat) == 0:
        return np.empty(0, dtype=np.uint64)
    cells = coordinates_to_cells(
        np.ascontiguousarray(lat, dtype=np.float64),
        np.ascontiguousarray(lon, dtype=np.float64),
        resolution,
    )
    out: npt.NDArray[np.uint64] = pa.array(cells).to_numpy(zero_copy_only=False)
    return out.astype(np.uint64, copy=False)
