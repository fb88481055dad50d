"""A node's work routed by Raft group (multi-raft step 3): each item goes to
its group's handler and one of a group the node does not run is refused;
the queue server hears each data group's role at once and its indexes as
group 0's (with every result, and promptly while reads wait)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from node_daemon.work.routing import WorkRouter
from roadlog.v1 import work_pb2
from tests.unit.node_daemon.work.test_fence_wait import _link, _Node, _sent, _settle

pytestmark = pytest.mark.unit


class _Handler:
    def __init__(self, name: str) -> None:
        self.name = name
        self.flowing: list[bool] = []

    async def run(self, item: work_pb2.WorkItem) -> work_pb2.WorkResult:
        return work_pb2.WorkResult(id=item.id, message=self.name)

    def reads_flowing(self, link: object, on: bool) -> None:
        self.flowing.append(on)


def test_items_go_to_their_groups_handler_and_no_other() -> None:
    handlers: dict[int, Any] = {0: _Handler("meta"), 2: _Handler("two")}
    work = WorkRouter(handlers)

    async def run(group: int) -> work_pb2.WorkResult:
        return await work.run(work_pb2.WorkItem(id=9, method="Fetch", group=group))

    assert asyncio.run(run(0)).message == "meta" and asyncio.run(run(2)).message == "two"
    refused = asyncio.run(run(3))
    assert refused.code == grpc.StatusCode.UNAVAILABLE.value[0] and refused.id == 9
    assert "runs no group 3" in refused.message
    work.reads_flowing(object(), True)
    assert handlers[0].flowing == handlers[2].flowing == [True]
    with pytest.raises(ValueError):
        WorkRouter({})
    # A worker process's: data groups only; group 0's items are refused there.
    worker = WorkRouter({1: _Handler("one")})  # type: ignore[dict-item]
    zero = asyncio.run(worker.run(work_pb2.WorkItem(id=4, method="Fetch", group=0)))
    assert zero.code == grpc.StatusCode.UNAVAILABLE.value[0] and "runs no group 0" in zero.message


def _with_data_groups(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _Node, dict[int, _Node]]:
    link, node, _ = _link(monkeypatch)
    data = {1: _Node(), 2: _Node()}
    link.data_groups = data  # type: ignore[assignment]
    link._told_state(link.state())
    return link, node, data


def test_the_link_tells_each_data_groups_role_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        link, _, data = _with_data_groups(monkeypatch)
        link.fence_wait(0, False)
        assert not _sent(link)
        data[2].is_leader, data[2].core.term = True, 7  # this node now leads group 2
        link.state_changed()
        [st] = _sent(link)
        assert [(g.group, g.is_leader, g.term) for g in st.groups] == [(1, False, 3), (2, True, 7)]

    asyncio.run(main())


def test_a_data_groups_index_moves_are_told_like_group_0s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        link, _, data = _with_data_groups(monkeypatch)
        link._told_at -= 1  # a queue server that never tells fences: every move promptly
        data[1].apply(5)  # only group 1 moved
        link.state_changed()
        [st] = _sent(link)
        assert {g.group: (g.applied_index, g.commit_index) for g in st.groups} == {
            1: (5, 5),
            2: (0, 0),
        }
        link.state_changed()  # nothing moved since: nothing to tell now
        assert not _sent(link)
        data[2].apply(3)
        await _settle(0.2)  # within INDEX_EVERY_S of the last word: told when it is up
        link.state_changed()
        assert [g.applied_index for s in _sent(link) for g in s.groups if g.group == 2] == [3]

    asyncio.run(main())


def test_a_worker_process_link_tells_its_data_groups_and_nothing_of_group_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker process's link (``data_groups_only``): its state names the
    node and its groups only, with no status (its main process speaks for
    the node); group 0's indexes (``node`` is one of its data groups) never
    count as moves to tell."""

    async def main() -> None:
        link, node, data = _with_data_groups(monkeypatch)
        link.data_groups_only = True
        link._told_state(link.state())
        st = link.state()
        assert st.data_groups_only and st.node_id == node.id
        assert (st.is_leader, st.term, st.applied_index, st.commit_index) == (False, 0, 0, 0)
        assert not st.HasField("status") and [g.group for g in st.groups] == [1, 2]
        link._told_at -= 1  # every move promptly
        node.apply(9)  # the node given for its id moved: not group 0's, nothing to tell
        link.state_changed()
        assert not _sent(link)
        data[1].is_leader = True
        link.state_changed()
        [told] = _sent(link)
        assert told.data_groups_only and told.groups[0].group == 1 and told.groups[0].is_leader
        assert not told.HasField("status")

    asyncio.run(main())
