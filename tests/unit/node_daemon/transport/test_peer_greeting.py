"""The peer link's greeting (issue 42): each side says its release and the
frame formats it speaks in ``FramesEndpoint``; a peer of an older release
(the fields absent) is spoken to in format 1, as before; a peer that shares
no format is refused with an error logged, and the node goes on (the link
is asked again, and comes up once one side speaks the other's format)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from node_daemon.raft import Message
from node_daemon.transport import peer_transport
from node_daemon.transport.peer_frames import (
    FORMATS,
    FormatRefused,
    agreed_format,
    told_formats,
)
from roadlog.release import release
from roadlog.v1 import raft_pb2
from tests.unit.node_daemon.transport.test_peer_frames import _append, _serving, _transport
from tests.unit.support.loops import run_bounded, until

pytestmark = pytest.mark.unit


def test_the_newest_format_both_speak_is_agreed_and_none_common_is_refused() -> None:
    assert told_formats(0, 0) == (1, 1)  # a release from before the greeting
    assert told_formats(3, 0) == (3, 3)
    assert agreed_format((1, 1), 0, 0) == 1
    assert agreed_format((1, 3), 2, 1) == 2  # an older peer: its newest
    assert agreed_format((1, 2), 5, 2) == 2  # a newer peer that still speaks ours
    with pytest.raises(FormatRefused, match=r"newer than this release's 1\.\.1: upgrade this node"):
        agreed_format((1, 1), 3, 2)
    with pytest.raises(FormatRefused, match=r"older than this release's 2\.\.3: upgrade the peer"):
        agreed_format((2, 3), 0, 0)


def test_each_side_says_its_release_and_formats_and_an_older_peer_gets_format_1(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        got_b: list[Message] = []
        b = _transport(2, tmp_path, got_b)
        server, addr = await _serving(b, True)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            b.greetings.greet = False  # b runs a release from before the greeting
            a.send([_append(1, 2, 1)])
            await until(lambda: len(got_b) == 1, "a message over the framed link")
            peer = next(iter(a.peers.values()))
            assert peer.format == 1 and peer.up
            assert a.greetings.releases[2] == ""  # said nothing: older
            assert b.greetings.releases[1] == release()  # a said who it is
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


def test_a_peer_of_no_common_format_is_refused_logged_and_reached_once_it_speaks_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(peer_transport, "FORMAT_REFUSED_RETRY_S", 0.05)

    async def body() -> None:
        got_b: list[Message] = []
        b = _transport(2, tmp_path, got_b)
        b.greetings.formats = (FORMATS[1] + 1, FORMATS[1] + 1)  # a release that dropped ours
        server, addr = await _serving(b, True)
        a = _transport(1, tmp_path, [])
        a.set_addresses({2: addr})
        try:
            with caplog.at_level(logging.ERROR, logger="roadlog.transport"):
                a.send([_append(1, 2, 1)])
                await until(lambda: len(caplog.records) >= 2, "both sides' refusals logged")
                for _ in range(5):  # asked again and again: refused, logged once, no crash
                    a.send([_append(1, 2, 1)])
                    await until(lambda: a.dropped > 0, "the message dropped")
                    a.dropped = 0
            refusals = [r for r in caplog.records if "no common frame format" in r.msg]
            assert len(refusals) == 2, [r.__dict__ for r in refusals]  # a's and b's, once each
            said = {r.__dict__["peer"]: r.__dict__["reason"] for r in refusals}
            assert "newer than this release's" in said[2] and "older than" in said[1]
            assert b.frames is not None
            assert not got_b and not b.frames.connections  # nothing sent, no link opened
            peer = next(iter(a.peers.values()))
            assert not peer.task.done()  # the link's task goes on
            b.greetings.formats = (FORMATS[0], FORMATS[1] + 1)  # b upgraded to speak ours too
            a.send([_append(1, 2, 2)])
            await until(lambda: len(got_b) == 1, "a message once a format is common", 15)
            assert peer.format == FORMATS[1]
        finally:
            await a.close()
            await b.close()
            await server.stop(None)

    run_bounded(body)


def test_the_reply_of_a_process_without_the_greeting_has_no_greeting_fields() -> None:
    # What an older release's reply is: the fields unset, read as format 1.
    reply = raft_pb2.FramesEndpointReply(port=7)
    assert (reply.release, reply.frames_format, reply.frames_format_oldest) == ("", 0, 0)
    assert told_formats(reply.frames_format, reply.frames_format_oldest) == (1, 1)
