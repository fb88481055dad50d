"""What goes over the pipe between a node's main process and its worker
processes (``pipe``): one frozen dataclass a kind of message, and their one
encoding (``encode``, ``decode``).

- main -> worker: ``Group0`` (first, before anything else, then as it
  moves), ``HandOver``, ``Stop``, ``AskMetrics`` (for a scrape).
- worker -> main: ``Ports`` (once listening), ``Groups`` (as they move),
  ``Metrics`` (the answer to an ``AskMetrics``).
- either way: ``ReadBarrier`` (a ReadIndex asked of the process that runs
  the group), answered by a ``Barrier`` with the same id.

The wire form of a message is a pickled tuple of plain values: its kind (the
class's name), then its fields in order; a nested dataclass
(``GroupFigures``) is a tuple of its own fields the same way, an enum (its
``Role``) an int. Nothing is per ping: these are figures, ids, ports and
one metrics text. ``decode`` refuses anything else
(``MalformedMessage``: an unknown kind, a class or other global in the
pickle, a field missing or of the wrong type, an invariant broken), so only
these dataclasses ever come out of a pipe.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, get_args, get_origin, get_type_hints

from node_daemon.replica.status import GroupFigures


class MalformedMessage(ValueError):
    """Bytes from the pipe that are not one of the messages below."""


def _check_conf(voters: tuple[int, ...], learners: tuple[int, ...]) -> None:
    if list(voters) != sorted(voters) or list(learners) != sorted(learners):
        raise ValueError("voters and learners come sorted")
    if set(voters) & set(learners):
        raise ValueError("a node is both voter and learner")


# ------------------------------------------------------------- main -> worker


@dataclass(frozen=True, slots=True)
class Group0:
    """Group 0 as a worker reads it (the main process runs it): its commit
    index, configuration, the node's peer addresses and the queue servers.

    Invariant: the first message a worker gets; sent again only when one of
    them moved; ``voters`` and ``learners`` sorted and disjoint."""

    commit_index: int
    voters: tuple[int, ...]
    learners: tuple[int, ...]
    addresses: dict[int, str]  # node id -> its address (the main process's copy)
    queue_servers: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_conf(self.voters, self.learners)


@dataclass(frozen=True, slots=True)
class HandOver:
    """Hand every group the worker leads to node ``to`` where it is a voter
    of the group, else to the group's best follower.

    Invariant: ``to`` >= 0 (0: each to its best follower)."""

    to: int = 0

    def __post_init__(self) -> None:
        if self.to < 0:
            raise ValueError(f"hand over to node {self.to}")


@dataclass(frozen=True, slots=True)
class Stop:
    """Hand over the groups the worker leads, then stop.

    Invariant: nothing; the last message a worker acts on."""


@dataclass(frozen=True, slots=True)
class AskMetrics:
    """The main process is being scraped: the worker answers with its
    ``Metrics``.

    Invariant: nothing; each ask is answered once, with the registry as it
    is when the ask is read."""


# ------------------------------------------------------------- worker -> main


@dataclass(frozen=True, slots=True)
class Ports:
    """Where the worker listens: its gRPC and framed peer ports.

    Invariant: sent once, when both listen; ``grpc`` > 0; ``frames`` 0 when
    the node runs no framed peer links."""

    grpc: int
    frames: int

    def __post_init__(self) -> None:
        if self.grpc <= 0 or self.frames < 0:
            raise ValueError(f"ports {self.grpc}, {self.frames}")


@dataclass(frozen=True, slots=True)
class Groups:
    """The figures of the worker's groups that moved since last told, each
    group's once (``replica.status.group_figures``: its commit index,
    configuration, role, term, leader, applied index; the main process's
    status of the group is made from them).

    Invariant: each group at most once, and none is group 0 (a worker runs
    data groups only); each one's voters and learners sorted and disjoint
    (``GroupFigures``)."""

    figures: tuple[GroupFigures, ...]

    def __post_init__(self) -> None:
        groups = {f.group for f in self.figures}
        if len(groups) != len(self.figures) or any(g < 1 for g in groups):
            raise ValueError(f"groups {[f.group for f in self.figures]} in one message")
        for f in self.figures:
            _check_conf(f.voters, f.learners)


@dataclass(frozen=True, slots=True)
class Metrics:
    """The worker's metrics, in Prometheus's text exposition format: the
    answer to an ``AskMetrics``.

    Invariant: all of its registry at one scrape; the next replaces it."""

    text: str


# ---------------------------------------------------------------- either way


@dataclass(frozen=True, slots=True)
class ReadBarrier:
    """Ask the process that runs ``group`` for a ReadIndex of it.

    Invariant: ``id`` is unique among the asker's open asks (> 0); it is
    answered by exactly one ``Barrier`` with that id (or the asker gives up
    when the other process dies)."""

    id: int
    group: int

    def __post_init__(self) -> None:
        if self.id <= 0 or self.group < 0:
            raise ValueError(f"ask {self.id} of group {self.group}")


@dataclass(frozen=True, slots=True)
class Barrier:
    """The answer to ``ReadBarrier`` ``id``: the group's ReadIndex
    ``index``, or ``error``, why there is none.

    Invariant: ``error`` is empty exactly when ``index`` is the answer."""

    id: int
    index: int = 0
    error: str = ""

    def __post_init__(self) -> None:
        if self.index < 0 or (self.error and self.index):
            raise ValueError(f"answer {self.id}: index {self.index} and error {self.error!r}")


Message = Group0 | HandOver | Stop | AskMetrics | Ports | Groups | Metrics | ReadBarrier | Barrier


# ------------------------------------------------------------------ encoding

_Conv = Callable[[Any], Any]


def _plain(kind: type) -> tuple[_Conv | None, _Conv]:
    def dec(v: Any) -> Any:
        # bool is an int, and an int is not a bool: exact types only.
        if type(v) is not kind:
            raise MalformedMessage(f"{v!r:.40} is not a {kind.__name__}")
        return v

    return None, dec


def _codec(hint: Any) -> tuple[_Conv | None, _Conv]:
    """(encode, decode) of one field's value, from its type: encode None
    when the value is sent as it is."""
    if hint in (int, bool, str, bytes):
        return _plain(hint)
    if isinstance(hint, type) and issubclass(hint, IntEnum):
        enum = hint

        def dec_enum(v: Any) -> Any:
            if type(v) is not int:
                raise MalformedMessage(f"{v!r:.40} is not a {enum.__name__}")
            try:
                return enum(v)
            except ValueError:
                raise MalformedMessage(f"{v} is not a {enum.__name__}") from None

        return int, dec_enum
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        enc_fields, dec_fields = _fields_codec(hint)
        return enc_fields, dec_fields
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        enc_item, dec_item = _codec(args[0])

        def enc_tuple(v: Any) -> Any:
            return tuple(v) if enc_item is None else tuple(enc_item(x) for x in v)

        def dec_tuple(v: Any) -> Any:
            if type(v) is not tuple:
                raise MalformedMessage(f"{v!r:.40} is not a tuple")
            return tuple(dec_item(x) for x in v)

        return enc_tuple, dec_tuple
    if origin is dict and len(args) == 2:
        (enc_k, dec_k), (enc_v, dec_v) = _codec(args[0]), _codec(args[1])
        if enc_k is not None or enc_v is not None:
            raise TypeError(f"a pipe message's dict holds plain values: {hint}")

        def dec_dict(v: Any) -> Any:
            if type(v) is not dict:
                raise MalformedMessage(f"{v!r:.40} is not a dict")
            return {dec_k(k): dec_v(x) for k, x in v.items()}

        return dict, dec_dict
    raise TypeError(f"no pipe encoding for {hint!r}")


def _fields_codec(cls: type) -> tuple[_Conv, _Conv]:
    """(encode, decode) of a dataclass as the tuple of its fields."""
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    convs = [_codec(hints[n]) for n in names]

    def enc(obj: Any) -> tuple[Any, ...]:
        return tuple(
            getattr(obj, n) if e is None else e(getattr(obj, n))
            for n, (e, _) in zip(names, convs, strict=True)
        )

    def dec(raw: Any) -> Any:
        if type(raw) is not tuple or len(raw) != len(names):
            raise MalformedMessage(f"{cls.__name__} has {len(names)} fields: {raw!r:.60}")
        values = [d(v) for v, (_, d) in zip(raw, convs, strict=True)]
        try:
            return cls(*values)
        except (TypeError, ValueError) as e:
            raise MalformedMessage(f"not a {cls.__name__}: {e}") from None

    return enc, dec


_KINDS: tuple[type, ...] = (
    Group0,
    HandOver,
    Stop,
    AskMetrics,
    Ports,
    Groups,
    Metrics,
    ReadBarrier,
    Barrier,
)
_ENCODE: dict[type, _Conv] = {}
_DECODE: dict[str, _Conv] = {}
for _kind in _KINDS:
    _ENCODE[_kind], _DECODE[_kind.__name__] = _fields_codec(_kind)
del _kind


def encode(msg: Message) -> bytes:
    """``msg``'s bytes on the pipe; TypeError for anything not a message."""
    enc = _ENCODE.get(type(msg))
    if enc is None:
        raise TypeError(f"not a pipe message: {type(msg).__name__}")
    return pickle.dumps((type(msg).__name__, *enc(msg)), protocol=pickle.HIGHEST_PROTOCOL)


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain values only: every class or function a pickle names is
    refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise MalformedMessage(f"a message holds plain values, not {module}.{name}")


def decode(data: bytes) -> Message:
    """The message ``data`` encodes; MalformedMessage for anything else."""
    try:
        raw = _PlainUnpickler(io.BytesIO(data)).load()
    except MalformedMessage:
        raise
    except Exception as e:  # a torn or foreign pickle: whatever pickle raises
        raise MalformedMessage(f"not a pickle: {type(e).__name__}: {e}") from None
    if type(raw) is not tuple or not raw or type(raw[0]) is not str:
        raise MalformedMessage(f"not a message: {raw!r:.60}")
    dec = _DECODE.get(raw[0])
    if dec is None:
        raise MalformedMessage(f"no message is called {raw[0]!r:.40}")
    msg: Message = dec(raw[1:])
    return msg
