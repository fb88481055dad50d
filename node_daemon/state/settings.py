"""Cluster settings in the replicated state (issue 39): what the operator
chooses for the whole cluster, set with ``roadlog cluster settings set``.

Kept in ``meta`` under ``setting/KEY`` as the value's canonical text, and
only once set: a key never set (every key of a state from before settings)
has its default. Every known key is in ``SETTINGS``; a value is checked
(``canonical``) by the leader before it proposes and again where the op is
applied, so every replica stores or refuses the same values.

- ``open_registration_scopes``: the scopes a self-registered identity
  (``POST /v1/clients``, ``RegisterClient``) is given; known scope forms
  only (``produce:``, ``read:``, ``heatmap:`` of a topic or ``*``), never
  ``admin`` or ``ops``. An identity keeps the scopes it registered with.
- ``registration_per_minute``: the cluster-wide ceiling on
  self-registrations a minute, kept by group 0's leader (every
  registration passes it), beside each queue server's own per-/24 rate.
- ``registration_idle_days``: a self-registered identity not used for
  this many days (on the log's clock, recorded a day at a time) is
  forgotten by the retention trim, its token then unknown (``clients``);
  0: never. Identities an admin made are never forgotten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from roadlog.errors import Code, RoadlogError
from roadlog.scopes import OPERATOR_SCOPES, PHONE_SCOPES, check_scopes
from roadlog.v1 import settings_pb2

OPEN_REGISTRATION_SCOPES = "open_registration_scopes"
REGISTRATION_PER_MINUTE = "registration_per_minute"
MAX_REGISTRATION_PER_MINUTE = 1_000_000
REGISTRATION_IDLE_DAYS = "registration_idle_days"
MAX_IDLE_DAYS = 36_500
_PREFIX = b"setting/"


def _scopes(value: str) -> str:
    """Scopes separated by commas or spaces, checked, in the order given."""
    scopes = check_scopes(s for s in value.replace(",", " ").split() if s)
    closed = [s for s in scopes if s in OPERATOR_SCOPES]
    if closed:
        raise ValueError(f"a self-registered identity may never have {', '.join(closed)}")
    return ",".join(scopes)


def _per_minute(value: str) -> str:
    n = int(value.strip())
    if not 1 <= n <= MAX_REGISTRATION_PER_MINUTE:
        raise ValueError(f"must be in 1..{MAX_REGISTRATION_PER_MINUTE}")
    return str(n)


def _idle_days(value: str) -> str:
    n = int(value.strip())
    if not 0 <= n <= MAX_IDLE_DAYS:
        raise ValueError(f"must be in 0..{MAX_IDLE_DAYS} (0: never forgotten)")
    return str(n)


@dataclass(frozen=True, slots=True)
class Setting:
    key: str
    default: str
    help: str
    check: Callable[[str], str]  # the canonical text of a value; ValueError if bad


SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        Setting(
            OPEN_REGISTRATION_SCOPES,
            ",".join(PHONE_SCOPES),
            "scopes a self-registered identity gets (never admin or ops)",
            _scopes,
        ),
        Setting(
            REGISTRATION_PER_MINUTE,
            "600",
            "self-registrations a minute in the whole cluster (group 0's leader counts)",
            _per_minute,
        ),
        Setting(
            REGISTRATION_IDLE_DAYS,
            "30",
            "days a self-registered identity may go unused before it is forgotten (0: never)",
            _idle_days,
        ),
    )
}


def known(key: str) -> Setting:
    """The setting named ``key``; NOT_FOUND naming the known ones if none."""
    found = SETTINGS.get(key)
    if found is None:
        raise RoadlogError(
            Code.NOT_FOUND, f"no cluster setting {key!r}: known are {', '.join(sorted(SETTINGS))}"
        )
    return found


def canonical(key: str, value: str) -> str:
    """``value`` of ``key`` in its canonical text; NOT_FOUND for an unknown
    key, INVALID_ARGUMENT (saying why) for a bad value."""
    setting = known(key)
    try:
        return setting.check(value)
    except ValueError as e:
        raise RoadlogError(Code.INVALID_ARGUMENT, f"{key} = {value!r}: {e}") from None


class SettingsTable:
    """The settings in ``meta`` (see the module's doc)."""

    def __init__(self, meta: Any) -> None:
        self.meta = meta

    def put(self, txn: Any, key: str, value: str) -> settings_pb2.ClusterSetting:
        """Store ``key``'s value, checked again here (every replica alike)."""
        text = canonical(key, value)
        txn.put(_PREFIX + key.encode(), text.encode(), db=self.meta)
        return self.one(txn, key)

    def value(self, txn: Any, key: str) -> str:
        """The value in force: the stored one, else the default."""
        raw = txn.get(_PREFIX + key.encode(), db=self.meta)
        return bytes(raw).decode() if raw is not None else known(key).default

    def one(self, txn: Any, key: str) -> settings_pb2.ClusterSetting:
        s = known(key)
        raw = txn.get(_PREFIX + key.encode(), db=self.meta)
        return settings_pb2.ClusterSetting(
            key=key,
            value=bytes(raw).decode() if raw is not None else s.default,
            default=s.default,
            set=raw is not None,
            help=s.help,
        )

    def listing(self, txn: Any, key: str = "") -> list[settings_pb2.ClusterSetting]:
        """Every known setting by key, or only ``key`` (NOT_FOUND if unknown)."""
        return [self.one(txn, k) for k in ([key] if key else sorted(SETTINGS))]


def scopes_of(value: str) -> list[str]:
    """The scopes of an ``open_registration_scopes`` value."""
    return [s for s in value.split(",") if s]
