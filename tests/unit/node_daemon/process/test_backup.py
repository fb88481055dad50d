"""Backups are authenticated and private (issue 19, finding 14): the manifest
carries an HMAC-SHA256 under a backup key only operators hold, so a backup
changed without the key (state and SHA-256 rewritten together, or the
manifest edited) is refused; every file is 0600 in a 0700 directory whatever
the umask; the key file is refused when missing, short, a placeholder or
open to the group or others."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from node_daemon.process.backup import (
    MANIFEST,
    STATE_FILE,
    BackupError,
    backup_files,
    read_backup_key,
    restore_backup,
    take_backup,
    verify_backup,
)
from node_daemon.process.main import cli
from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine
from node_daemon.storage.raft_log import LmdbLogStorage

pytestmark = pytest.mark.unit

KEY = b"0123456789abcdef2b7e151628aed2a6"  # not one pattern repeated: a key passes its check


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """A umask that would leave new files 0644 (the daemons set 077 themselves)."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    sm = StateMachine(data / "state", map_size=1 << 24)
    try:
        sm.apply([Entry(1, 1, EntryType.NORMAL, b""), Entry(1, 2, EntryType.NORMAL, b"")])
    finally:
        sm.close()
    return data


def key_file(path: Path, content: bytes = KEY, mode: int = 0o600) -> Path:
    path.write_bytes(content + b"\n")
    path.chmod(mode)
    return path


def rewrite_manifest(backup: Path, **changes: object) -> None:
    doc = json.loads((backup / MANIFEST).read_text())
    doc.update(changes)
    (backup / MANIFEST).write_text(json.dumps(doc))


def test_a_backup_is_private_and_verifies_under_its_key(
    data_dir: Path, tmp_path: Path, loose_umask: None
) -> None:
    out = tmp_path / "backups" / "b1"
    manifest = take_backup(data_dir, out, "lab", 1, KEY)
    assert manifest.applied_index == 2 and manifest.format == 2
    assert out.stat().st_mode & 0o777 == 0o700
    files = sorted(p.name for p in out.iterdir())
    assert files == [MANIFEST, STATE_FILE]
    for p in out.iterdir():
        assert p.stat().st_mode & 0o777 == 0o600, f"{p} is {p.stat().st_mode & 0o777:o}"
    assert "hmac_sha256" in json.loads((out / MANIFEST).read_text())
    assert verify_backup(out, "lab", KEY) == manifest
    # No partial directory is left next to it.
    assert [p.name for p in out.parent.iterdir()] == ["b1"]


def test_a_tampered_backup_is_refused(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    take_backup(data_dir, out, "lab", 1, KEY)
    # The attack of finding 14: change the state and put its new SHA-256 in
    # the manifest; a plain checksum cannot tell.
    state = out / STATE_FILE
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    with pytest.raises(BackupError, match="SHA-256 does not match"):
        verify_backup(out, "lab", KEY)
    rewrite_manifest(out, sha256=hashlib.sha256(bytes(raw)).hexdigest())
    with pytest.raises(BackupError, match="HMAC does not match"):
        verify_backup(out, "lab", KEY)


@pytest.mark.parametrize(
    "changes",
    [{"applied_index": 1}, {"cluster_name": "other"}, {"node_id": 9}, {"format": 1}],
)
def test_an_edited_manifest_is_refused(
    data_dir: Path, tmp_path: Path, changes: dict[str, object]
) -> None:
    out = tmp_path / "b"
    take_backup(data_dir, out, "lab", 1, KEY)
    rewrite_manifest(out, **changes)
    with pytest.raises(BackupError, match="HMAC does not match"):
        verify_backup(out, "other" if "cluster_name" in changes else "lab", KEY)


def test_another_key_or_an_unsigned_manifest_is_refused(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    take_backup(data_dir, out, "lab", 1, KEY)
    with pytest.raises(BackupError, match="another backup key"):
        verify_backup(out, "lab", b"another-key-of-32-bytes-000000000")
    doc = json.loads((out / MANIFEST).read_text())
    del doc["hmac_sha256"]
    doc["format"] = 1
    (out / MANIFEST).write_text(json.dumps(doc))  # what a backup of before looked like
    with pytest.raises(BackupError, match="not authenticated"):
        verify_backup(out, "lab", KEY)


def test_a_restore_under_the_wrong_key_moves_nothing(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    take_backup(data_dir, out, "lab", 1, KEY)
    before = sorted(p.name for p in data_dir.iterdir())
    with pytest.raises(BackupError, match="HMAC"):
        restore_backup(data_dir, out, "lab", {1: "127.0.0.1:7400"}, b"x" * 32)
    assert sorted(p.name for p in data_dir.iterdir()) == before


def test_the_backup_key_file_must_be_private_long_and_real(tmp_path: Path) -> None:
    assert read_backup_key(key_file(tmp_path / "ok")) == KEY
    with pytest.raises(BackupError, match="required"):
        read_backup_key(None)
    with pytest.raises(BackupError, match="cannot read"):
        read_backup_key(tmp_path / "absent")
    for mode in (0o640, 0o604, 0o620):
        with pytest.raises(BackupError, match="group or others"):
            read_backup_key(key_file(tmp_path / f"m{mode:o}", mode=mode))
    with pytest.raises(BackupError, match="at least 16 bytes"):
        read_backup_key(key_file(tmp_path / "short", b"0123456789"))
    with pytest.raises(BackupError, match="placeholder"):
        read_backup_key(key_file(tmp_path / "ph", b"CHANGE-ME-CHANGE-ME-CHANGE-ME"))
    with pytest.raises(BackupError, match="at least 16 bytes"):
        take_backup(tmp_path, tmp_path / "b", "lab", 1, b"short")


def test_the_cli_needs_the_key_and_takes_it_from_a_file_or_stdin(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loose_umask: None
) -> None:
    # (loose_umask also puts back the umask the CLI's private_files() sets.)
    monkeypatch.delenv("ROADLOG_BACKUP_KEY_FILE", raising=False)
    runner = CliRunner()
    base = ["--data-dir", str(data_dir), "--cluster-name", "lab", "--json"]
    r = runner.invoke(cli, ["backup", *base, "--out", str(tmp_path / "b0")])
    assert r.exit_code == 2 and "--backup-key-file" in r.output, r.output
    assert not (tmp_path / "b0").exists()
    shared = key_file(tmp_path / "shared.key", mode=0o640)
    key_flag = ["--backup-key-file", str(shared)]
    r = runner.invoke(cli, ["backup", *base, "--out", str(tmp_path / "b0"), *key_flag])
    assert r.exit_code == 2 and "group or others" in r.output, r.output
    # From stdin, as the playbooks and fab pass it.
    out = tmp_path / "b1"
    r = runner.invoke(
        cli,
        ["backup", *base, "--out", str(out), "--backup-key-file", "-"],
        input=KEY.decode() + "\n",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["applied_index"] == 2
    # The files to fetch, as fab and backup.yml read them from this JSON.
    files = json.loads(r.output)["files"]
    assert files == [MANIFEST, STATE_FILE] and all((out / f).is_file() for f in files)
    good = key_file(tmp_path / "good.key")
    check = ["verify-backup", "--cluster-name", "lab", "--from", str(out)]
    r = runner.invoke(cli, [*check, "--backup-key-file", str(good)])
    assert r.exit_code == 0 and json.loads(r.output)["applied_index"] == 2, r.output
    other = key_file(tmp_path / "other.key", b"fedcba9876543210d41d8cd98f00b204")
    monkeypatch.setenv("ROADLOG_BACKUP_KEY_FILE", str(other))
    r = runner.invoke(cli, check)
    assert r.exit_code == 1 and "HMAC does not match" in r.output, r.output


def test_a_node_with_data_groups_is_backed_up_and_restored_group_by_group(
    tmp_path: Path, loose_umask: None
) -> None:
    data = tmp_path / "data"
    digests: dict[int, bytes] = {}
    for g, n in ((0, 2), (1, 5), (2, 3)):  # each group at its own index
        where = data if g == 0 else data / "groups" / str(g)
        sm = StateMachine(where / "state", map_size=1 << 24)
        try:
            sm.apply([Entry(1, i, EntryType.NORMAL, b"") for i in range(1, n + 1)])
            digests[g] = sm.digest()
        finally:
            sm.close()
    out = tmp_path / "b"
    manifest = take_backup(data, out, "lab", 1, KEY)
    assert manifest.applied_index == 2
    assert {g: e["applied_index"] for g, e in manifest.groups.items()} == {"1": 5, "2": 3}
    for name in ("1", "2"):
        f = out / "groups" / name / STATE_FILE
        assert (
            f.stat().st_mode & 0o777 == 0o600
            and (out / "groups" / name).stat().st_mode & 0o777 == 0o700
        )
    assert verify_backup(out, "lab", KEY).groups == manifest.groups
    # What `fab backup` and backup.yml fetch (`backup --json` lists it): every
    # file the backup holds, the data groups' too (the lab found a backup
    # fetched without them, which a restore refused).
    held = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file())
    assert sorted(backup_files(asdict(manifest))) == held
    assert backup_files({"applied_index": 2}) == [MANIFEST, STATE_FILE]

    aside = restore_backup(data, out, "lab", {1: "127.0.0.1:1", 2: "127.0.0.1:2"}, KEY)
    assert (aside / "groups" / "1" / "state").is_dir()  # the old data, moved aside
    for g, index in ((0, 2), (1, 5), (2, 3)):
        where = data if g == 0 else data / "groups" / str(g)
        sm = StateMachine(where / "state", map_size=1 << 24)
        try:
            assert sm.applied_index == index
        finally:
            sm.close()
        store = LmdbLogStorage(where / "raft")
        try:
            snap = store.snapshot().meta
            assert (snap.index, sorted(snap.conf.voters)) == (index, [1, 2])
        finally:
            store.close()

    # A data group's copy changed: refused, like group 0's.
    f = out / "groups" / "2" / STATE_FILE
    f.write_bytes(f.read_bytes()[:-1] + b"\x01")
    with pytest.raises(BackupError, match="groups/2"):
        verify_backup(out, "lab", KEY)


def test_a_backup_without_data_groups_keeps_the_manifest_of_before(
    data_dir: Path, tmp_path: Path
) -> None:
    """No ``groups`` key unless there are data groups: a release from
    before them reads (and verifies) such a backup as its own."""
    take_backup(data_dir, tmp_path / "b", "lab", 1, KEY)
    doc = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert "groups" not in doc
    assert verify_backup(tmp_path / "b", "lab", KEY).groups == {}


@pytest.fixture
def referring_data_dir(tmp_path: Path) -> Path:
    """A node's group 0 whose state stores its batches as references into
    its Raft log (one copy per node), the log compacted past them."""
    from node_daemon.raft import ConfState, Snapshot, SnapshotMeta
    from tests.unit.node_daemon.state.test_state_machine import T0, Log, pings

    data = tmp_path / "data"
    log = LmdbLogStorage(data / "raft", map_size=1 << 26)
    sm = StateMachine(data / "state", map_size=1 << 26, entries=log)
    try:
        feed = Log(sm)
        feed.create()
        for k in range(4):
            feed.append(pings(20, start=k * 20), at_ms=T0 + k)
        oldest = sm.oldest_entry_ref()
        snap = SnapshotMeta(sm.applied_index, 1, ConfState(frozenset({1})))
        log.compact(Snapshot(snap, b""), retain_from=oldest)
    finally:
        sm.close()
        log.close()
    return data


def test_a_backup_carries_the_log_entries_its_state_refers_to(
    referring_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from node_daemon.raft.errors import MissingEntryError
    from node_daemon.storage import kept_log

    real = kept_log.bundle_from_log_dir
    calls = []

    def let_go_once(*args: object) -> None:
        calls.append(args)
        if len(calls) == 1:  # a compaction let the entries go between the two reads
            raise MissingEntryError("entry 2 is not kept", 2)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kept_log, "bundle_from_log_dir", let_go_once)
    out = tmp_path / "b1"
    take_backup(referring_data_dir, out, "lab", 1, KEY)
    assert len(calls) == 2  # read again, whole
    assert kept_log.kept_range(out / STATE_FILE) == (2, 5)
    verify_backup(out, "lab", KEY)

    def always(*args: object) -> None:
        raise MissingEntryError("entry 2 is not kept", 2)

    monkeypatch.setattr(kept_log, "bundle_from_log_dir", always)
    with pytest.raises(BackupError, match="let entries the state refers to go"):
        take_backup(referring_data_dir, tmp_path / "b2", "lab", 1, KEY)
