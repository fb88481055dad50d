"""The type check of a daemon's numeric and true/false config keys.

A TOML file has types: ``http_body_timeout_s = "30"`` (a quoted number, as
a template easily writes) is text, not a number, and is refused at start
with the key named, never carried into the daemon to fail later or compare
wrongly. A flag is text by nature, so a value from the command line (or
given as text in ``overrides``) is parsed, and refused if it does not parse.

Invariants: an ``int`` key holds an ``int`` (never a ``bool``, never a float
cut to an int); a ``float`` key holds a finite ``float`` (an integer is
taken as one); a ``bool`` key holds a ``bool``. Keys of other types pass
unchanged.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["typed"]

_KINDS = {int: "an integer", float: "a number", bool: "true or false"}


def typed(kind: Any, value: Any, *, text: bool) -> Any:
    """``value`` for a key declared as ``kind``, checked (and for a float,
    made one); ``text``: the value came from a flag, so a string is parsed.
    ValueError saying what was wanted and what came otherwise (the loader
    names the key)."""
    if kind not in _KINDS:
        return value
    if text and isinstance(value, str):
        value = _parse(kind, value)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif isinstance(value, bool):
        pass  # True is an int to Python, never a number to a config
    elif kind is int and isinstance(value, int):
        return value
    elif kind is float and isinstance(value, int | float):
        if math.isfinite(value):
            return float(value)
        raise ValueError(f"must be a finite number, not {value!r}")
    raise ValueError(f"must be {_KINDS[kind]}, not {_shown(value)}")


def _parse(kind: Any, value: str) -> Any:
    s = value.strip()
    try:
        if kind is bool:
            if s.lower() in ("true", "false"):
                return s.lower() == "true"
            raise ValueError
        return int(s) if kind is int else float(s)
    except ValueError:
        raise ValueError(f"must be {_KINDS[kind]}, not {value!r}") from None


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f"the text {value!r} (write it without quotes)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    return f"{value!r} ({type(value).__name__})"
