"""Idle self-registered identities are forgotten (issue 39, item 2), in the
state machine on real LMDB: the retention trim records the identities seen
used on the log's day and forgets those unused for longer than the cluster
setting ``registration_idle_days``; admins' identities never go; a full
cap refuses registrations only, never tokens issued; and what holds the
names between trims is bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import node_daemon.state.clients as clients
from node_daemon.raft import Entry, EntryType
from node_daemon.state.clients import DAY_MS, UsedNames, day_of
from node_daemon.state.machine import StateMachine, trim_op
from node_daemon.state.responses import OpResult
from node_daemon.state.settings import REGISTRATION_IDLE_DAYS
from queue_server.auth import Authenticator, UsedReport
from roadlog.errors import Code
from roadlog.scopes import PHONE_SCOPES, new_token, token_hash
from roadlog.v1 import clients_pb2, command_pb2, settings_pb2

pytestmark = pytest.mark.unit

T0 = 1_800_000_000_000  # a day's start plus some hours
DAY0 = day_of(T0)


class Replicas:
    """Two replicas applying the same entries."""

    def __init__(self, path: Path) -> None:
        self.sms = [StateMachine(path / n, map_size=64 << 20) for n in "ab"]
        self.index = 0

    def apply(self, op: command_pb2.Op, at_ms: int) -> OpResult:
        self.index += 1
        cmd = command_pb2.Command(leader_ms=at_ms, ops=[op]).SerializeToString()
        results = [sm.apply([Entry(1, self.index, EntryType.NORMAL, cmd)])[0][0] for sm in self.sms]
        assert results[0].code == results[1].code
        return results[0]

    def create(self, name: str, at_ms: int, registered: bool = True) -> tuple[str, OpResult]:
        token = new_token()
        scopes = list(PHONE_SCOPES) if registered else ["read:*"]
        ident = clients_pb2.ClientIdentity(
            name=name, client_id=f"cl-{name}", scopes=scopes, registered=registered
        )
        op = command_pb2.CreateClientOp(identity=ident, token_hash=token_hash(token))
        return token, self.apply(command_pb2.Op(create_client=op), at_ms)

    def trim(self, at_ms: int, used: tuple[str, ...] = (), forget: bool = True) -> None:
        res = self.apply(trim_op(clients_used=used, forget_idle_clients=forget), at_ms)
        assert res.code == Code.OK, res.message

    def set_idle_days(self, days: str, at_ms: int) -> OpResult:
        req = settings_pb2.SetSettingRequest(key=REGISTRATION_IDLE_DAYS, value=days)
        return self.apply(command_pb2.Op(set_setting=command_pb2.SetSettingOp(request=req)), at_ms)

    def known(self, token: str) -> bool:
        found = [sm.identity(token_hash(token)) is not None for sm in self.sms]
        assert found[0] == found[1]
        return found[0]

    def same(self) -> None:
        assert self.sms[0].digest() == self.sms[1].digest()


def test_idle_registered_identities_are_forgotten_used_and_admin_ones_kept(
    tmp_path: Path,
) -> None:
    r = Replicas(tmp_path)
    idle, _ = r.create("cl-idle", T0)
    used, _ = r.create("cl-used", T0)
    admin, _ = r.create("dashboard", T0, registered=False)
    assert r.sms[0].identity_counts() == (1, 2)
    stored = r.sms[0].identity(token_hash(used))
    assert stored is not None and stored.used_day == DAY0
    # Day 20: cl-used is seen; nothing is idle for 30 days yet.
    r.trim(T0 + 20 * DAY_MS, used=("cl-used", "dashboard", "no-such-one"))
    assert all(r.known(t) for t in (idle, used, admin))
    # Day 31: cl-idle was last used 31 days ago: forgotten; cl-used (day
    # 20) and the admin's (never forgotten) stay.
    r.trim(T0 + 31 * DAY_MS)
    assert not r.known(idle)
    assert r.known(used) and r.known(admin)
    assert r.sms[0].identity_counts() == (1, 1)
    assert r.sms[0].forgotten == 1
    # Long after: the admin's identity is still there, cl-used is not.
    r.trim(T0 + 400 * DAY_MS)
    assert not r.known(used) and r.known(admin)
    assert r.sms[0].identity_counts() == (1, 0)
    r.same()


def test_the_setting_decides_and_zero_never_forgets(tmp_path: Path) -> None:
    r = Replicas(tmp_path)
    assert r.set_idle_days("-1", T0).code == Code.INVALID_ARGUMENT
    assert r.set_idle_days("0", T0).code == Code.OK
    phone, _ = r.create("cl-phone", T0)
    r.trim(T0 + 1000 * DAY_MS)
    assert r.known(phone)
    assert r.set_idle_days("2", T0 + 1000 * DAY_MS).code == Code.OK
    r.trim(T0 + 1000 * DAY_MS)
    assert not r.known(phone)
    r.same()


def test_a_trim_from_before_forgets_nothing(tmp_path: Path) -> None:
    r = Replicas(tmp_path)
    phone, _ = r.create("cl-phone", T0)
    r.trim(T0 + 1000 * DAY_MS, forget=False)  # an entry from before idle identities went
    assert r.known(phone)


def test_identities_from_before_count_as_used_on_the_first_forgetting_day(
    tmp_path: Path,
) -> None:
    r = Replicas(tmp_path)
    old, _ = r.create("cl-old", T0)
    # As a state from before stored it: no used_day, no index, no mark.
    for sm in r.sms:
        with sm.env.begin(write=True) as txn:
            raw = bytes(txn.get(b"rcl-old", db=sm.clients.clients) or b"")
            ident = clients_pb2.ClientIdentity.FromString(raw[32:])
            txn.delete(clients._used_key(ident.used_day, b"cl-old"), db=sm.clients.clients)
            ident.used_day = 0
            txn.put(b"rcl-old", raw[:32] + ident.SerializeToString(), db=sm.clients.clients)
    r.trim(T0 + 100 * DAY_MS)  # the first: it counts as used today
    assert r.known(old)
    r.trim(T0 + 130 * DAY_MS)
    assert r.known(old)
    r.trim(T0 + 131 * DAY_MS)
    assert not r.known(old)
    r.same()


def test_a_full_cap_refuses_registrations_never_issued_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clients, "MAX_REGISTERED", 3)
    r = Replicas(tmp_path)
    tokens = []
    for i in range(3):
        token, res = r.create(f"cl-{i}", T0)
        assert res.code == Code.OK
        tokens.append(token)
    _, refused = r.create("cl-more", T0 + DAY_MS)
    assert refused.code == Code.RESOURCE_EXHAUSTED
    assert all(r.known(t) for t in tokens)  # tokens issued keep working
    admin, made = r.create("dashboard", T0 + DAY_MS, registered=False)
    assert made.code == Code.OK and r.known(admin)  # the admins' cap is another
    # cl-0 idles out; its place is free again.
    r.trim(T0 + 31 * DAY_MS, used=("cl-1", "cl-2"))
    assert not r.known(tokens[0]) and r.known(tokens[1]) and r.known(tokens[2])
    again, res = r.create("cl-more", T0 + 31 * DAY_MS)
    assert res.code == Code.OK and r.known(again)
    r.same()


def test_the_forgetting_per_trim_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clients, "FORGOTTEN_PER_TRIM", 2)
    r = Replicas(tmp_path)
    tokens = [r.create(f"cl-{i}", T0 + i)[0] for i in range(3)]
    r.trim(T0 + 40 * DAY_MS)
    assert [r.known(t) for t in tokens] == [False, False, True]
    r.trim(T0 + 40 * DAY_MS)
    assert not r.known(tokens[2])


def test_used_names_held_for_the_trim_are_bounded() -> None:
    held = UsedNames(limit=3)
    assert held.add(["a", "b", "a"]) == 2
    assert held.add(["c", "d"]) == 3  # d is dropped (told again the next day it is used)
    assert held.take(2) == ["a", "b"]
    assert held.take(5) == ["c"]
    assert held.take() == []


def test_a_queue_server_tells_each_identity_once_a_day() -> None:
    now = [float(DAY0 * 86_400)]
    report = UsedReport(clock=lambda: now[0], max_names=2)
    for name in ("a", "b", "a", "c"):  # c: over the bound for today
        report.note(name)
    assert report.take(10) == ["a", "b"]
    report.note("a")
    assert report.take(10) == []  # told today
    report.give_back(["b"])  # its telling failed
    assert report.take(10) == ["b"]
    now[0] += 86_400
    report.note("a")
    assert report.take(10) == ["a"]


def test_the_authenticator_notes_self_registered_identities_only() -> None:
    phone, van = new_token(), new_token()
    known = {
        token_hash(phone): clients_pb2.ClientIdentity(
            name="cl-p", client_id="cl-p", registered=True
        ),
        token_hash(van): clients_pb2.ClientIdentity(name="van", client_id="cl-v"),
    }

    async def lookup(h: bytes, source: str) -> clients_pb2.AuthenticateResponse:
        ident = known.get(h)
        return clients_pb2.AuthenticateResponse(found=ident is not None, identity=ident)

    async def main() -> list[str]:
        auth = Authenticator(lookup)
        for token in (phone, van, phone):
            await auth.principal(f"Bearer {token}")
        return auth.used.take(10)

    assert asyncio.run(main()) == ["cl-p"]
