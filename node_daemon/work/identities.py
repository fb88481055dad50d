"""The node's side of client identities (issue 19) and of what the operator
chooses for them (issue 39): identities made, registered, revoked, listed
and looked up; cluster settings read and set; a topic's access fields
changed. Part of ``WorkHandler`` (a mixin: its methods are the work items'
handlers, ``roadlog.rpc``).

Self-registration (``register_client``), on group 0's leader, which every
registration passes: the identity gets the scopes the cluster setting
``open_registration_scopes`` holds when it is proposed, and the cluster's
ceiling ``registration_per_minute`` is a token bucket here (a burst of a
minute's worth); a new leader starts with a full bucket, so a leadership
change can let one more minute's worth through. Refused: RESOURCE_EXHAUSTED
with when to come back (``Throttled``: HTTP 429 with Retry-After).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from node_daemon.replica.replica import NotLeader, Replica
from node_daemon.state.responses import OpResult
from node_daemon.state.settings import (
    OPEN_REGISTRATION_SCOPES,
    REGISTRATION_PER_MINUTE,
    canonical,
    scopes_of,
)
from node_daemon.state.topics import updated_spec
from roadlog.errors import Code, RoadlogError, Throttled
from roadlog.scopes import ScopeError, check_client_name, check_scopes
from roadlog.v1 import client_pb2, clients_pb2, command_pb2, settings_pb2, work_pb2


class RegistrationCeiling:
    """A token bucket of ``per_minute`` a minute (burst: as many), its rate
    read afresh at each take (the setting may change)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.level: float | None = None  # None: full (nothing taken yet)
        self.at = 0.0

    def take(self, per_minute: int) -> float:
        """0 if one is taken now, else the seconds until one could be."""
        now = self.clock()
        level = float(per_minute) if self.level is None else self.level
        level = min(float(per_minute), level + (now - self.at) * per_minute / 60)
        self.at = now
        if level >= 1.0:
            self.level = level - 1.0
            return 0.0
        self.level = level
        return (1.0 - level) * 60 / per_minute


class IdentityWork:
    """The identity, settings and topic-access handlers of ``WorkHandler``."""

    node: Replica
    registrations: RegistrationCeiling

    async def _fenced(self, fence: int) -> None:
        if self.node.sm.applied_index < fence:
            await self.node.wait_applied(fence, timeout=10)

    async def authenticate_at_leader(self, item: work_pb2.WorkItem) -> OpResult:
        """``authenticate`` on the leader, which has applied every identity
        whose creation it answered (a follower may not have yet)."""
        if not self.node.is_leader:
            raise NotLeader(self.node.core.lead)
        return await self.authenticate(item)

    async def clients_used(self, item: work_pb2.WorkItem) -> OpResult:
        """Self-registered identities a queue server saw used: held for the
        next trim, which records them (one entry for them all)."""
        if not self.node.is_leader:
            raise NotLeader(self.node.core.lead)
        req = clients_pb2.ClientsUsedRequest.FromString(item.request)
        held = self.node.clients_used.add(n for n in req.names if 0 < len(n.encode()) <= 255)
        return OpResult(response=clients_pb2.ClientsUsedResponse(pending=held).SerializeToString())

    async def create_client(self, item: work_pb2.WorkItem) -> OpResult:
        """An identity an admin asked for: the queue server made its token
        and sends only the hash."""
        req = clients_pb2.CreateClientRequest.FromString(item.request)
        return await propose_client(self.node, req.name, list(req.scopes), req.token_hash)

    async def register_client(self, item: work_pb2.WorkItem) -> OpResult:
        """A phone's own identity: named by its client id, with the scopes
        of ``open_registration_scopes`` whatever the request says, within
        the cluster's ceiling (see the module's doc)."""
        req = clients_pb2.RegisterClientRequest.FromString(item.request)
        if not self.node.is_leader:
            raise NotLeader(self.node.core.lead)
        per_minute = int(self.node.sm.setting(REGISTRATION_PER_MINUTE))
        wait = self.registrations.take(per_minute)
        if wait:
            raise Throttled(
                f"too many registrations in the cluster: at most {per_minute} a minute "
                f"(cluster setting {REGISTRATION_PER_MINUTE}); try again in {wait:.1f} s",
                wait,
            )
        scopes = scopes_of(self.node.sm.setting(OPEN_REGISTRATION_SCOPES))
        return await propose_client(self.node, "", scopes, req.token_hash, True)

    async def revoke_client(self, item: work_pb2.WorkItem) -> OpResult:
        req = clients_pb2.RevokeClientRequest.FromString(item.request)
        op = command_pb2.RevokeClientOp(name=req.name)
        return await self.node.propose_op(command_pb2.Op(revoke_client=op))

    async def list_clients(self, item: work_pb2.WorkItem) -> OpResult:
        req = clients_pb2.ListClientsRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        return OpResult(response=self.node.sm.list_clients().SerializeToString())

    async def authenticate(self, item: work_pb2.WorkItem) -> OpResult:
        """The queue server's question: whose token has this hash?"""
        req = clients_pb2.AuthenticateRequest.FromString(item.request)
        await self._fenced(max(item.fence, req.min_applied_index))
        ident = self.node.sm.identity(req.token_hash)
        resp = clients_pb2.AuthenticateResponse(found=ident is not None)
        if ident is not None:
            resp.identity.CopyFrom(ident)
        return OpResult(response=resp.SerializeToString())

    # ------------------------------------------------------------ settings

    async def get_settings(self, item: work_pb2.WorkItem) -> OpResult:
        """On group 0's leader (``roadlog.rpc``), which applied every set it
        answered."""
        req = settings_pb2.GetSettingsRequest.FromString(item.request)
        if not self.node.is_leader:
            raise NotLeader(self.node.core.lead)
        resp = settings_pb2.GetSettingsResponse(settings=self.node.sm.list_settings(req.key))
        return OpResult(response=resp.SerializeToString())

    async def set_setting(self, item: work_pb2.WorkItem) -> OpResult:
        """Checked here first (a bad value costs no log entry), and again
        where applied."""
        req = settings_pb2.SetSettingRequest.FromString(item.request)
        req.value = canonical(req.key, req.value)
        return await self.node.propose_op(
            command_pb2.Op(set_setting=command_pb2.SetSettingOp(request=req))
        )

    async def update_topic(self, item: work_pb2.WorkItem) -> OpResult:
        """A topic's access fields (group 0's record), checked here first."""
        req = client_pb2.UpdateTopicRequest.FromString(item.request)
        updated_spec(self.node.sm.topic(req.name).spec, req)  # NOT_FOUND, INVALID_ARGUMENT
        return await self.node.propose_op(
            command_pb2.Op(update_topic=command_pb2.UpdateTopicOp(request=req))
        )


async def propose_client(
    node: Replica, name: str, scopes: list[str], token_hash: bytes, registered: bool = False
) -> OpResult:
    """Propose a new identity (leader only: else NotLeader), its client id
    drawn here at random (96 bits); ``name`` "": the client id."""
    if not node.is_leader:
        raise NotLeader(node.core.lead)
    client_id = f"cl-{secrets.token_hex(12)}"
    try:
        name = check_client_name(name or client_id)
        scopes = check_scopes(scopes)
    except (ScopeError, ValueError) as e:
        raise RoadlogError(Code.INVALID_ARGUMENT, str(e)) from None
    if len(token_hash) != 32:
        raise RoadlogError(Code.INVALID_ARGUMENT, "a token hash is 32 bytes (SHA-256)")
    ident = clients_pb2.ClientIdentity(
        name=name, client_id=client_id, scopes=scopes, registered=registered
    )
    op = command_pb2.CreateClientOp(identity=ident, token_hash=token_hash)
    return await node.propose_op(command_pb2.Op(create_client=op))
