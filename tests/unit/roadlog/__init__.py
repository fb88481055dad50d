"""Unit tests of roadlog's shared model and client SDK (columnar, geo, errors,
limits, rpc, placement, the Producer and publisher)."""
