"""Cluster logic for operators (the Fabric CLI, the playbooks' checks), as
pure functions over what hosts report, so it is tested without SSH.

A host's view is a roadlog.leadership.HostView; who leads and whom to hand
leadership to are decided there, shared with ``roadlog-node transfer-leader``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from roadlog.leadership import HostView, leader_host


def restart_order(views: Sequence[HostView]) -> list[str]:
    """Every host, followers first (in name order), the leader last: the
    cluster pays for one election at most, at the very end."""
    lead = leader_host(views)
    return sorted(v.host for v in views if v.host != lead) + ([lead] if lead else [])


def lag(views: Sequence[HostView]) -> dict[str, int]:
    """Entries each host has yet to apply, against the leader's commit
    index (or the highest commit index seen when there is no leader)."""
    lead = leader_host(views)
    ref = next((v.commit_index for v in views if v.host == lead), None)
    if ref is None:
        ref = max((v.commit_index for v in views if v.reachable), default=0)
    return {v.host: max(0, ref - v.applied_index) for v in views if v.reachable}


def health_problems(views: Sequence[HostView], max_lag: int = 1000) -> list[str]:
    """Why the cluster is not healthy; empty when every host's node is up,
    ready, a member, agrees on one leader, and is within `max_lag`."""
    problems = []
    for v in views:
        if not v.reachable:
            problems.append(f"{v.host}: node not answering (service {v.service})")
        elif not v.ready:
            problems.append(f"{v.host}: node not ready")
        elif not v.member:
            problems.append(f"{v.host}: not a member of the cluster")
    lead = leader_host(views)
    if lead is None:
        problems.append("no leader")
    else:
        lead_id = next(v.node_id for v in views if v.host == lead)
        disagree = [v.host for v in views if v.reachable and v.leader != lead_id]
        if disagree:
            problems.append(f"{', '.join(disagree)}: see another leader than {lead}")
    for host, behind in lag(views).items():
        if behind > max_lag:
            problems.append(f"{host}: {behind} entries behind")
    return problems


def write_pause(ack_times: Iterable[float], fault_at: float) -> float:
    """How long writes stopped after a fault: the longest gap between
    consecutive acknowledgements from the last one before `fault_at` on
    (seconds; inf when none came after). The longest gap, not the first:
    the fault's timestamp is taken just before it is injected, so a few
    acknowledgements may still arrive between the two."""
    times = sorted(ack_times)
    before = [t for t in times if t <= fault_at]
    after = [t for t in times if t > fault_at]
    if not after:
        return float("inf")
    series = [before[-1] if before else fault_at, *after]
    return max(b - a for a, b in pairwise(series))


def status_rows(views: Sequence[HostView]) -> list[dict[str, Any]]:
    """One row per host for `fab status`: role, term, leader, lag, service."""
    behind = lag(views)
    lead = leader_host(views)
    return [
        {
            "host": v.host,
            "service": v.service,
            "node_id": v.node_id,
            "role": v.role if v.reachable else "down",
            "term": v.term,
            "leader": v.host == lead,
            "applied_index": v.applied_index,
            "lag": behind.get(v.host),
            "ready": v.ready,
        }
        for v in views
    ]


DEFAULT_CERTS_DIR = "/etc/roadlog/certs"  # roles: roadlog_common_certs_dir
OPERATOR_CLIENT = "ops"  # roles: roadlog_tls_operator_client


def client_tls_env(daemon_config: str | None, client: str = OPERATOR_CLIENT) -> dict[str, str]:
    """The environment a tool on a roadlog host dials the cluster with
    (``ClientTLS.from_env``), from the TOML of a daemon there (None: no such
    file): plaintext only where that daemon runs ``insecure``; else TLS that
    trusts the ``ca.crt`` of its ``certs_dir`` and presents the client
    certificate ``client.CLIENT`` beside it (the roles push the operators'
    there), as calls to nodes need. ValueError for a file that is not TOML."""
    try:
        doc = tomllib.loads(daemon_config) if daemon_config else {}
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not a daemon's TOML: {e}") from None
    if doc.get("insecure") is True:
        return {"ROADLOG_INSECURE": "1"}
    certs = str(doc.get("certs_dir") or DEFAULT_CERTS_DIR).rstrip("/")
    return {
        "ROADLOG_CA_FILE": f"{certs}/ca.crt",
        "ROADLOG_CERT_FILE": f"{certs}/client.{client}.crt",
        "ROADLOG_KEY_FILE": f"{certs}/client.{client}.key",
    }


def operator_token_file(
    hostvars: Mapping[str, Mapping[str, Any]], repo: Path, name: str = OPERATOR_CLIENT
) -> Path:
    """Where the roles keep the operators' admin token on the controller
    (role roadlog_identities), from the inventory's variables:
    ``roadlog_identities_dir``, else ``roadlog_tls_controller_dir``/tokens,
    else the roles' default ``pki/CLUSTER/tokens`` in the repository ``repo``;
    the file is ``roadlog_identities_operator`` (else ``name``) ``.token``. A
    variable whose value is a template is not used (it is the roles' to
    render)."""

    def var(key: str) -> str | None:
        for v in hostvars.values():
            x = v.get(key)
            if isinstance(x, str) and x and "{{" not in x:
                return x
        return None

    tokens = var("roadlog_identities_dir")
    if tokens is None:
        cluster = var("roadlog_common_cluster_name") or "roadlog"
        tokens = f"{var('roadlog_tls_controller_dir') or repo / 'pki' / cluster}/tokens"
    return Path(tokens) / f"{var('roadlog_identities_operator') or name}.token"


@dataclass(frozen=True)
class SshHost:
    """A host of the Ansible inventory, as Fabric connects to it."""

    name: str
    address: str
    user: str = "root"
    key_file: str | None = None
    port: int = 22

    @property
    def needs_sudo(self) -> bool:
        return self.user != "root"


def hosts_from_inventory(doc: dict[str, Any]) -> dict[str, list[SshHost]]:
    """Groups of hosts from `ansible-inventory --list` JSON (group -> hosts,
    in inventory order; children groups are flattened)."""
    hostvars: dict[str, dict[str, Any]] = doc.get("_meta", {}).get("hostvars", {})

    def host(name: str) -> SshHost:
        v = hostvars.get(name, {})
        return SshHost(
            name=name,
            address=str(v.get("ansible_host", name)),
            user=str(v.get("ansible_user", "root")),
            key_file=v.get("ansible_ssh_private_key_file"),
            port=int(v.get("ansible_port", 22)),
        )

    def members(group: str, seen: frozenset[str] = frozenset()) -> list[str]:
        if group in seen:
            return []
        g = doc.get(group, {})
        names = list(g.get("hosts", []))
        for child in g.get("children", []):
            names += members(child, seen | {group})
        return list(dict.fromkeys(names))

    groups = [k for k in doc if k != "_meta"]
    return {g: [host(n) for n in members(g)] for g in groups}
