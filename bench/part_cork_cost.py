"""What corking a data group's parts saves or costs, in one process (issue
42, ``node_daemon/work/part_cork.py``): K parts of split publishes (each a
part of ``--publishes`` publishes of ``--pings`` pings, over a partition of
its own, or with ``--joined`` over the same ``--partitions`` of the group's
partitions, the shape ``bench/ingest.py --split`` makes)
applied as K ops of one entry, against merged into one op first and applied
as one: CPU per part of the leader's merge, of one replica's apply, and of
the entry's encoding, on a real StateMachine (LMDB in a temporary
directory). A replica applies every entry, so the apply figure counts three
times on 3 nodes; the merge once, on the leader.

    python -m bench.part_cork_cost --parts 1,2,4,8 --rounds 200
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine
from node_daemon.store.data_group_topics import next_topic_op
from node_daemon.work import part_cork
from roadlog import columnar
from roadlog.columnar import PingColumns, encode
from roadlog.v1 import command_pb2
from tests.unit.node_daemon.state.test_state_machine import Log

T0 = 1_800_000_000_000


def make_part(
    topic_id: int, k: int, partitions: list[int], publishes: int, pings: int
) -> command_pb2.AppendOp:
    per = max(1, pings // len(partitions))
    op = command_pb2.AppendOp(topic="bench", topic_id=topic_id)
    now = int(time.time() * 1000)
    for p in partitions:
        n = per * publishes
        devices = [f"dev-{k}-{p}-{i % 12}" for i in range(n)]
        cols = PingColumns.from_columns(
            devices, [now - i for i in range(n)], [48.1] * n, [11.5] * n
        )
        op.parts.add(partition=p, batch=encode(cols), count=n)
    for j in range(publishes):
        op.spans.add(
            client_id="bench", producer_id=1000 + k, sequence=j, counts=[per] * len(partitions)
        )
    return op


class Group:
    def __init__(self, path: Path) -> None:
        meta = StateMachine(path / "meta")
        record = Log(meta).create("bench", partitions=8).topic
        del record.partition_groups[:]
        record.partition_groups.extend([1] * 8)
        self.sm = StateMachine(path / "data", issues_producers=False)
        self.index = 0
        op = next_topic_op({"bench": record}, self.sm.topic_records(), 1)
        assert op is not None
        self.apply([op])
        self.topic_id = record.id
        meta.close()

    def apply(self, ops: list[command_pb2.Op]) -> float:
        """CPU seconds of encoding and applying one entry of ``ops``."""
        t0 = time.process_time()
        self.index += 1
        data = command_pb2.Command(leader_ms=T0, ops=ops).SerializeToString()
        self.sm.apply([Entry(1, self.index, EntryType.NORMAL, data)])
        return time.process_time() - t0


def _joined(ops: list[command_pb2.AppendOp], out: command_pb2.AppendOp) -> None:
    """Parts that share partitions as one op: each partition's batches
    joined (parse, join, encode), each span widened."""
    order: list[int] = []
    batches: dict[int, list[bytes]] = {}
    counts: dict[int, int] = {}
    for op in ops:
        for part in op.parts:
            if part.partition not in batches:
                order.append(part.partition)
                batches[part.partition], counts[part.partition] = [], 0
            batches[part.partition].append(part.batch)
            counts[part.partition] += part.count
    out.topic, out.topic_id = ops[0].topic, ops[0].topic_id
    column = {p: i for i, p in enumerate(order)}
    for p in order:
        got = batches[p]
        joined = (
            got[0] if len(got) == 1 else encode(columnar.join([columnar.parse(b) for b in got]))
        )
        out.parts.add(partition=p, batch=joined, count=counts[p])
    for op in ops:
        at = [column[part.partition] for part in op.parts]
        for span in op.spans:
            row = [0] * len(order)
            for i, c in zip(at, span.counts, strict=True):
                row[i] = c
            out.spans.add(
                client_id=span.client_id,
                producer_id=span.producer_id,
                sequence=span.sequence,
                counts=row,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parts", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--publishes", type=int, default=11, help="publishes a part has spans of")
    ap.add_argument("--pings", type=int, default=100, help="pings a publish has in the group")
    ap.add_argument("--partitions", type=int, default=3, help="the group's partitions a part has")
    ap.add_argument(
        "--joined",
        action="store_true",
        help="the parts share their partitions, joined by re-encoding each shared "
        "partition's batches (what part_cork did first, and gave up); default: each part "
        "its own partitions (what part_cork merges)",
    )
    args = ap.parse_args(argv)
    print(
        "parts  apply alone us/part  merge us/part  apply corked us/part  "
        "saved on 3 replicas us/part"
    )
    for k in [int(x) for x in args.parts.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            alone_g, corked_g = Group(Path(d) / "a"), Group(Path(d) / "c")
            shared = list(range(args.partitions))
            alone = merge = corked = 0.0
            for r in range(args.rounds):
                ops = [
                    make_part(
                        alone_g.topic_id,
                        r * 64 + i,
                        shared if args.joined else [i % 8],
                        args.publishes,
                        args.pings,
                    )
                    for i in range(k)
                ]
                # Which goes first alternates: the parts were just made (warm).
                if r % 2:
                    alone += alone_g.apply([command_pb2.Op(append=o) for o in ops])
                t0 = time.process_time()
                wrapper = command_pb2.Op()
                if k == 1:
                    wrapper.append.CopyFrom(ops[0])
                elif args.joined:
                    _joined(ops, wrapper.append)
                else:
                    part_cork.merge(ops, wrapper.append)
                merge += time.process_time() - t0
                corked += corked_g.apply([wrapper])
                if not r % 2:
                    alone += alone_g.apply([command_pb2.Op(append=o) for o in ops])
            n = args.rounds * k
            a, m, c = (1e6 * x / n for x in (alone, merge, corked))
            print(f"{k:5d}  {a:19.1f}  {m:13.1f}  {c:20.1f}  {3 * (a - c) - m:27.1f}")
            alone_g.sm.close()
            corked_g.sm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
