"""Operator logic without SSH: leader, restart order, health, lag, transfer
target, the drill's write pause."""

from __future__ import annotations

import math

import pytest

from roadlog.leadership import HostView, leader_host, transfer_target
from roadlog.tools.ops import (
    health_problems,
    hosts_from_inventory,
    lag,
    restart_order,
    status_rows,
    write_pause,
)

pytestmark = pytest.mark.unit


def view(
    host: str, node_id: int, role: str, term: int = 3, leader: int = 2, **kw: object
) -> HostView:
    doc = {
        "node_id": node_id,
        "role": role,
        "term": term,
        "leader": leader,
        "commit_index": kw.pop("commit", 100),
        "applied_index": kw.pop("applied", 100),
        "member": kw.pop("member", True),
        "ready": kw.pop("ready", True),
    }
    return HostView.from_readyz(host, doc, "active")


def healthy() -> list[HostView]:
    return [view("lab1", 1, "follower"), view("lab2", 2, "leader"), view("lab3", 3, "follower")]


def test_the_leader_is_restarted_last_and_followers_in_name_order() -> None:
    views = [view("lab3", 3, "follower"), view("lab2", 2, "leader"), view("lab1", 1, "follower")]
    assert leader_host(views) == "lab2"
    assert restart_order(views) == ["lab1", "lab3", "lab2"]


def test_a_stale_leader_of_an_older_term_is_not_the_leader() -> None:
    views = [
        view("lab1", 1, "leader", term=2, leader=1),
        view("lab2", 2, "leader", term=3, leader=2),
        view("lab3", 3, "follower", term=3, leader=2),
    ]
    assert leader_host(views) == "lab2"
    assert restart_order(views) == ["lab1", "lab3", "lab2"]


def test_without_a_leader_every_host_is_restarted_in_name_order() -> None:
    views = [view("lab2", 2, "candidate", leader=0), HostView("lab1")]
    assert leader_host(views) is None
    assert restart_order(views) == ["lab1", "lab2"]
    assert "no leader" in health_problems(views)


def test_a_healthy_cluster_has_no_problems_and_each_fault_is_named() -> None:
    assert health_problems(healthy()) == []
    down = [*healthy()[:2], HostView.from_readyz("lab3", None, "failed")]
    assert health_problems(down) == ["lab3: node not answering (service failed)"]
    behind = [*healthy()[:2], view("lab3", 3, "follower", applied=10)]
    assert health_problems(behind, max_lag=50) == ["lab3: 90 entries behind"]
    assert lag(behind) == {"lab1": 0, "lab2": 0, "lab3": 90}
    learner = [*healthy()[:2], view("lab3", 3, "follower", member=False)]
    assert health_problems(learner) == ["lab3: not a member of the cluster"]
    split = [*healthy()[:2], view("lab3", 3, "follower", leader=1)]
    assert health_problems(split) == ["lab3: see another leader than lab2"]


def test_leadership_goes_to_the_most_caught_up_ready_member() -> None:
    views = [
        view("lab1", 1, "follower", applied=90),
        view("lab2", 2, "leader"),
        view("lab3", 3, "follower", applied=99),
        view("lab4", 4, "follower", applied=100, member=False),
    ]
    assert transfer_target(views) == 3
    assert transfer_target(views, prefer=1) == 1
    assert transfer_target(views, prefer=4) == 0  # not a voter
    assert transfer_target([view("lab2", 2, "leader")]) == 0


def test_leadership_never_goes_to_a_standby_learner() -> None:
    # A learner added by add_node.yml is a member, ready and the most caught
    # up; it can never lead (the lab's rolling restart after add_node was
    # refused: "node 4 is not a voter").
    views = [
        view("lab1", 1, "follower", applied=90),
        view("lab2", 2, "leader"),
        view("lab3", 3, "follower", applied=95),
        view("lab4", 4, "follower", applied=100),
    ]
    assert transfer_target(views) == 4  # not told the voters: any member
    assert transfer_target(views, voters={1, 2, 3}) == 3
    assert transfer_target(views, prefer=4, voters={1, 2, 3}) == 0
    assert transfer_target(views, voters={2}) == 0


def test_the_write_pause_spans_the_fault() -> None:
    acks = [0.0, 0.1, 0.2, 0.3, 1.5, 1.6]
    assert write_pause(acks, fault_at=0.35) == pytest.approx(1.2)
    assert write_pause(acks, fault_at=-1.0) == pytest.approx(1.2)  # from the fault on
    assert math.isinf(write_pause([0.0, 0.1], fault_at=0.5))
    # Acknowledgements that slipped in between the timestamp and the kill.
    assert write_pause([0.0, 0.1, 0.31, 0.32, 1.5, 1.51], fault_at=0.3) == pytest.approx(1.18)


def test_status_rows_mark_the_leader_and_down_hosts() -> None:
    rows = status_rows([*healthy()[:2], HostView.from_readyz("lab3", None, "inactive")])
    assert [r["leader"] for r in rows] == [False, True, False]
    assert rows[2]["role"] == "down" and rows[2]["lag"] is None and rows[2]["service"] == "inactive"


def test_inventory_groups_become_ssh_hosts_with_their_connection_settings() -> None:
    doc = {
        "_meta": {
            "hostvars": {
                "lab1": {"ansible_host": "10.77.0.11", "ansible_user": "root",
                         "ansible_ssh_private_key_file": "/k"},
                "vm2": {"ansible_host": "10.0.0.12", "ansible_user": "azureuser",
                        "ansible_port": 2222},
            }
        },
        "all": {"children": ["ungrouped", "nodes", "roadlog"]},
        "nodes": {"hosts": ["lab1", "vm2"]},
        "roadlog": {"children": ["nodes", "spark_master"]},
        "spark_master": {"hosts": ["lab1"]},
    }  # fmt: skip
    groups = hosts_from_inventory(doc)
    assert [h.address for h in groups["nodes"]] == ["10.77.0.11", "10.0.0.12"]
    assert groups["nodes"][0].key_file == "/k" and not groups["nodes"][0].needs_sudo
    assert groups["nodes"][1].needs_sudo and groups["nodes"][1].port == 2222
    assert [h.name for h in groups["roadlog"]] == ["lab1", "vm2"]  # children flattened, once
    assert [h.name for h in groups["all"]] == ["lab1", "vm2"]


def test_client_tls_env_trusts_the_ca_with_the_operators_certificate_unless_insecure() -> None:
    """What fab's drill probe dials with, from the prober's queue.toml."""
    from roadlog.tools.ops import client_tls_env

    certs = "/etc/roadlog/certs"
    tls = {
        "ROADLOG_CA_FILE": f"{certs}/ca.crt",
        "ROADLOG_CERT_FILE": f"{certs}/client.ops.crt",
        "ROADLOG_KEY_FILE": f"{certs}/client.ops.key",
    }
    assert client_tls_env(None) == tls  # no config there: the roles' defaults
    assert client_tls_env("insecure = false\n") == tls
    assert client_tls_env('certs_dir = "/srv/c/"\n', "admin") == {
        "ROADLOG_CA_FILE": "/srv/c/ca.crt",
        "ROADLOG_CERT_FILE": "/srv/c/client.admin.crt",
        "ROADLOG_KEY_FILE": "/srv/c/client.admin.key",
    }
    assert client_tls_env('insecure = true\ncerts_dir = "/x"\n') == {"ROADLOG_INSECURE": "1"}
    assert client_tls_env('insecure = "true"\n') == tls  # only a TOML true turns TLS off
    with pytest.raises(ValueError, match="not a daemon's TOML"):
        client_tls_env("insecure = = 1")
