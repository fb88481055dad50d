"""Render BENCHMARKS.md from bench/results/*.json (run after the benchmarks)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS

OUT = Path(__file__).parents[1] / "BENCHMARKS.md"


def _load(name: str) -> dict[str, Any] | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _machine(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    load = m.get("load_average")
    busy = f"; load average {load[0]} / {load[1]} / {load[2]} when written" if load else ""
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Python {m['python']}, "
        f"kernel {m['kernel']}; {doc['when']}{busy}"
    )


def _transport_hop(hop: dict[str, Any]) -> list[str]:
    out = [
        "## One internal hop: gRPC aio stream against plain framed TCP",
        "",
        f"Machine: {_machine(hop)}. `bench/transport_hop.py`: a server process answers "
        "every message with 200 bytes; the client keeps that many exchanges in flight on one "
        "connection (one gRPC bidi stream, or length-prefixed frames on asyncio streams), "
        f"both on {hop.get('event_loop', 'asyncio')}. CPU of each side per exchange (one "
        "message each way), from /proc. This is the price of the transport alone in every "
        "replication round and Work stream message.",
        "",
        "| payload | in flight | transport | exchanges/s | client µs | server µs |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for c in hop["cases"]:
        out.append(
            f"| {c['payload_bytes']:,} B | {c['concurrency']} | {c['transport']} "
            f"| {c['exchanges_per_s']:,} | {c['client_us_per_exchange']} "
            f"| {c['server_us_per_exchange']} |"
        )
    return [*out, ""]


def _ingest_cpu(ing: dict[str, Any]) -> list[str]:
    """The server-CPU table of the ingest benchmark (empty for results
    recorded before the benchmark measured CPU)."""
    cases = [c for c in ing["cases"] if "server_cpu_s_per_m_pings" in c]
    if not cases:
        return []
    out = [
        "Server CPU over the same measured windows (user + system CPU-seconds of the "
        "server processes from /proc, the client left out), per million pings acknowledged, "
        "and each process's share of a core (1.0 = one core kept busy):",
        "",
        "| system | pings/message | server CPU-s per M pings | cores by process |",
        "| --- | ---: | ---: | --- |",
    ]
    for c in cases:
        cores = ", ".join(f"{k} {v:.2f}" for k, v in c["cores"].items())
        out.append(
            f"| {c['system']} | {c['pings_per_message']} | {c['server_cpu_s_per_m_pings']} "
            f"| {cores} |"
        )
    ratios = ing.get("cpu_ratio", {})
    if ratios:
        shown = ", ".join(f"{r}x at {b}" for b, r in ratios.items() if r is not None)
        out += ["", f"roadlog's server CPU per ping over JetStream's: {shown}."]
    return [*out, ""]


def _ingest_wide(doc: dict[str, Any]) -> list[str]:
    """The same ingest benchmark on a machine with many cores (the device
    tool's, when a session is lent one): where cores are not the limit,
    the ceiling is one leader process."""
    out = [
        "## Replicated ingest on 16 cores",
        "",
        f"Machine: {_machine(doc)}. `bench/ingest.py --systems roadlog,jetstream --batches "
        f"100,1000 --rounds {doc.get('rounds', 1)} --seconds {doc.get('seconds')}`, "
        f"{doc['concurrency']} publishers, the same load as above on a machine where cores are "
        "not the limit; each figure the median round, brackets the lowest and highest.",
        "",
        "| system | pings/message | pings/s | p50 / p99 ms | server CPU-s per M pings "
        "| cores by process |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in doc["cases"]:
        cores = ", ".join(f"{k} {v:.2f}" for k, v in c["cores"].items())
        out.append(
            f"| {c['system']} | {c['pings_per_message']} | {c['pings_per_s']:,.0f}{_spread(c)} "
            f"| {c['ack_p50_ms']} / {c['ack_p99_ms']} | {c['server_cpu_s_per_m_pings']} "
            f"| {cores} |"
        )
    ratio = ", ".join(f"{r} at {b}" for b, r in doc.get("ratio", {}).items())
    cpu = ", ".join(f"{r}x at {b}" for b, r in doc.get("cpu_ratio", {}).items())
    return [
        *out,
        "",
        f"roadlog's pings/s over JetStream's: {ratio}; server CPU per ping over JetStream's: "
        f"{cpu}.",
        "",
    ]


def _ingest_groups(doc: dict[str, Any]) -> list[str]:
    """Ingest with topics placed in G data groups (multi-raft, issue 18):
    roadlog for each G beside JetStream, on the machine that ran it; route
    ``fast`` (each message one group's pings, sent straight to its leader)
    or ``split`` (group 0's leader splits every message)."""
    out = [
        "## Ingest over data groups (multi-raft, place_topics)",
        "",
        f"Machine: {_machine(doc)} (the last of the runs below). `bench/ingest.py --groups G` "
        f"(G = {', '.join(str(g) for g in doc['groups'])}; 1 is one group, today's default), "
        "each case 2 rounds of 5 s (the median round; brackets: the lowest and highest), "
        "32 or 96 publishers in one client process. Route fast: each publisher sends one "
        "group's devices through `Publisher(group=g)`, so each message goes straight to its "
        "group's leader (docs/multiraft.md, the fast path); split (`--split`): messages of "
        "every group's devices, which group 0's leader validates and splits, and each part "
        "goes to its group's leader.",
        "",
        "| system | data groups | route | publishers | pings/message | pings/s | p50 / p99 ms "
        "| server CPU-s per M pings | cores by process |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in doc["cases"]:
        cores = ", ".join(f"{k} {v:.2f}" for k, v in c["cores"].items())
        groups = c.get("data_groups") or "-"
        out.append(
            f"| {c['system']} | {groups} | {c.get('route', '-')} | {c.get('concurrency', '')} "
            f"| {c['pings_per_message']} | {c['pings_per_s']:,.0f}{_spread(c)} "
            f"| {c['ack_p50_ms']} / {c['ack_p99_ms']} | {c['server_cpu_s_per_m_pings']} "
            f"| {cores} |"
        )
    return [
        *out,
        "",
        "Splitting every message costs more than spreading the groups gains: each corked "
        "call becomes a split on group 0's leader plus a part, a Raft entry and an answer in "
        "every group. Routed by group (fast), 3 groups on 3 nodes carry up to 3.0-3.3M pings/s "
        "at 1000 pings per message (one group: 1.9-2.6M; JetStream 3.4M), each node's process "
        "near one core; at 100 pings per message each group's publisher corks fewer "
        "publishes per call, and the fixed cost per call (issue 17) makes the CPU per ping "
        "grow with groups. 6 groups on 3 nodes (two leaders in one process, one core) are "
        "slower than 3. `place_topics` stays off by default until reads, Spark and backup "
        "follow the data groups.",
        "",
    ]


def _ingest_tls(doc: dict[str, Any]) -> list[str]:
    """What TLS costs (``bench/ingest.py --tls both``): each system's figures
    plaintext and over TLS, measured in one run."""
    cases = doc["cases"]

    def find(system: str, b: int, tls: bool) -> dict[str, Any] | None:
        return next(
            (
                c
                for c in cases
                if c["system"] == system and c["pings_per_message"] == b and c["tls"] == tls
            ),
            None,
        )

    out = [
        "## Ingest over TLS: what it costs",
        "",
        f"Machine: {_machine(doc)}. The same load as above, each system plaintext and then over "
        "TLS with certificates from one CA (roadlog: the client's PublishStream, the Raft peer "
        "links and the Work links, mutual between the cluster's processes; JetStream: the "
        "client port and the routes), in one run, each case the median of "
        f"{doc.get('rounds', 1)} round(s).",
        "",
        "| system | pings/message | pings/s plaintext | pings/s TLS | server CPU-s per M pings "
        "plaintext | TLS | TLS / plaintext |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    cost = doc.get("tls_cpu_cost", {})
    for system in doc["systems"]:
        for b in sorted({c["pings_per_message"] for c in cases}):
            plain, tls = find(system, b, False), find(system, b, True)
            if plain is None or tls is None:
                continue
            out.append(
                f"| {system} | {b} | {plain['pings_per_s']:,.0f} | {tls['pings_per_s']:,.0f} "
                f"| {plain['server_cpu_s_per_m_pings']} | {tls['server_cpu_s_per_m_pings']} "
                f"| {cost.get(system, {}).get(str(b))} |"
            )
    for key, what in (("cpu_ratio", "plaintext"), ("cpu_ratio_tls", "over TLS")):
        ratios = doc.get(key, {})
        if ratios:
            shown = ", ".join(f"{r}x at {b}" for b, r in ratios.items() if r is not None)
            out += ["", f"roadlog's server CPU per ping over JetStream's, {what}: {shown}."]
    return [*out, ""]


def _case(doc: dict[str, Any], system: str, batch: str) -> dict[str, Any]:
    return next(
        c for c in doc["cases"] if c["system"] == system and str(c["pings_per_message"]) == batch
    )


def _spread(case: dict[str, Any]) -> str:
    """ " (low-high)" over a case's rounds, when it had more than one."""
    runs = case.get("rounds_pings_per_s") or []
    if len(runs) < 2:
        return ""
    return f" ({_short(min(runs))}-{_short(max(runs))})"


def _short(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.0f}k" if x >= 1e4 else f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def render() -> str:
    lines = [
        "# Benchmarks",
        "",
        "Figures from `make bench` (rendered by `bench/report.py` from `bench/results/*.json`).",
        "Single runs (unless said otherwise) on a shared 2-core machine: read them as "
        "orders of magnitude.",
        "",
    ]
    st = _load("storage_ceiling")
    if st:
        lines += [
            "## Storage ceiling: Raft log appends to LMDB with fsync",
            "",
            f"Machine: {_machine(st)}. Pings of {st['ping_bytes']} bytes; each Raft entry "
            "carries one batch of pings; each save is one LMDB transaction and one fsync.",
            "",
            "| pings/entry | entries/fsync | entries/s | pings/s | MB/s | ms/fsync |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for c in st["cases"]:
            lines.append(
                f"| {c['pings_per_entry']} | {c['entries_per_fsync']} | {c['entries_per_s']:,.0f} "
                f"| {c['pings_per_s']:,.0f} | {c['mb_per_s']:.2f} | {c['ms_per_fsync']:.2f} |"
            )
        lines.append("")
    core = _load("core_commits")
    if core:
        lines += [
            "## The Raft core alone",
            "",
            f"Machine: {_machine(core)}. {core['nodes']} in-process nodes, instant delivery, "
            f"in-memory store, entries of {core['entry_bytes']} bytes (100 pings).",
            "",
            "| proposals per round | commits/s | µs per commit |",
            "| ---: | ---: | ---: |",
        ]
        for c in core["cases"]:
            lines.append(
                f"| {c['proposals_per_round']} | {c['commits_per_s']:,.0f} | {c['us_per_commit']} |"
            )
        lines.append("")
    if st and core:
        by = {(c["pings_per_entry"], c["entries_per_fsync"]): c for c in st["cases"]}
        single, grouped = by.get((1, 1)), by.get((1, 32))
        big = by.get((1000, 1))
        one, many = core["cases"][0], core["cases"][-1]
        if single and grouped and big:
            lines += [
                "## Reading",
                "",
                f"- One fsync costs about {single['ms_per_fsync']:.2f} ms here, so one entry per "
                f"fsync tops out near {single['fsyncs_per_s']:,.0f} entries/s for small "
                f"entries; group commit (32 entries a fsync) gives "
                f"{grouped['entries_per_s'] / single['entries_per_s']:.0f}x the entries.",
                f"- Packing pings into columnar batches is what makes ping throughput: "
                f"{big['pings_per_s']:,.0f} pings/s with 1000-ping entries against "
                f"{single['pings_per_s']:,.0f} with one ping an entry.",
                f"- The core is not the bottleneck: {many['commits_per_s']:,.0f} commits/s "
                f"pipelined ({one['commits_per_s']:,.0f}/s one proposal at a time, a full "
                "replication round each), far above the fsync ceiling.",
                "",
            ]
    ing = _load("ingest")
    if ing:
        lines += [
            "## Replicated ingest: roadlog against NATS JetStream",
            "",
            f"Machine: {_machine(ing)}. Three roadlog nodes behind one queue server, and three "
            "nats-server processes (3 replicas, file storage, `sync_interval: always`), "
            f"all on loopback on the same 2 cores; {ing['concurrency']} concurrent async "
            f"publishers in one client process (event loop: {ing.get('event_loop', 'asyncio')}, "
            "the daemons' too); pings of 36-40 bytes packed the same number per "
            "message; non-idempotent publishes on both sides. roadlog publishes through "
            "`roadlog.publisher` (corked: the publishes made while earlier calls are out "
            "travel together in one PublishBatch, as nats-py buffers publishes into one "
            "socket write, sent as one message on a long-lived PublishStream; each is still "
            "validated, stored and acknowledged on its own); the "
            "unary column is one `Publish` call per message.",
            "",
            "| pings/message | roadlog pings/s | p50 / p99 ms | publishes per call "
            "| unary pings/s | JetStream pings/s | p50 / p99 ms | ratio |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for b, ratio in ing["ratio"].items():
            o = next(
                c
                for c in ing["cases"]
                if c["system"] == "roadlog" and str(c["pings_per_message"]) == b
            )
            t = next(
                c
                for c in ing["cases"]
                if c["system"] == "jetstream" and str(c["pings_per_message"]) == b
            )
            u = next(
                (
                    c
                    for c in ing["cases"]
                    if c["system"] == "roadlog-unary" and str(c["pings_per_message"]) == b
                ),
                None,
            )
            unary = f"{u['pings_per_s']:,.0f}{_spread(u)}" if u else "-"
            lines.append(
                f"| {b} | {o['pings_per_s']:,.0f}{_spread(o)} "
                f"| {o['ack_p50_ms']} / {o['ack_p99_ms']} "
                f"| {o.get('publishes_per_call', 1)} | {unary} "
                f"| {t['pings_per_s']:,.0f}{_spread(t)} | {t['ack_p50_ms']} / {t['ack_p99_ms']} "
                f"| {ratio} |"
            )
        lines += _ingest_cpu(ing)
        lines += [
            "Where the time goes is written up hop by hop in "
            "`bench/profiles/write-path.md` (py-spy with `--gil`, per-thread CPU from /proc, "
            "the daemons' counters): at 100 pings per message most of the server CPU is a "
            "fixed cost per corked call (gRPC aio and asyncio hand-overs in the queue server, "
            "the leader and the followers), not a cost per ping. What closed part of the gap: "
            "length-prefixed frames on plain TCP for the Raft peer link and the queue "
            "server's Work link instead of gRPC streams (the system roadlog-grpc above is "
            "roadlog with both over gRPC, in the same run), frames read in place, one "
            "long-lived PublishStream per client instead of a call per batch, then the "
            "publish link (frames, not gRPC, between client and queue server), the log's "
            "latest entries applied from memory, snapshots as page copies, "
            "corking (publishes per call above), the leader validating a corked batch while "
            "its log write runs, merged publishes decoded together (one array per column), a "
            "C-parsed PingBatch view, one pass over a call's appends, apply without building "
            "answers where nobody waits, each op serialized once, no commit-only APPEND under "
            "steady writes, index updates to queue servers only while fenced reads wait, "
            "rectangle regions checked without shapely, and uvloop. Run to run this varies by "
            f"15-25% on both sides, so each case ran {ing.get('rounds', 1)} time(s), the "
            "sizes taking turns; a figure is the median round (with its latencies and CPU), "
            "the brackets give the lowest and highest round, and the ratios are of the "
            "medians. Earlier figures: 634 / 57.3k / 515k pings/s (ratios 0.07 / 0.10 / "
            "0.37), unary calls without these changes. The goals (issue 17): server CPU per "
            "ping at most JetStream's at 1000 pings per message and at most 1.5x at 100; "
            "throughput at least JetStream's at both.",
            "",
        ]
    wide = _load("ingest-16core")
    if wide:
        lines += _ingest_wide(wide)
    spread = _load("ingest-16core-groups")
    if spread:
        lines += _ingest_groups(spread)
    ing_tls = _load("ingest-tls")
    if ing_tls and ing_tls.get("tls") == "both":
        lines += _ingest_tls(ing_tls)
    hop = _load("transport_hop")
    if hop:
        lines += _transport_hop(hop)
    fd = _load("front_door")
    if fd:
        lines += [
            "## The front door: many small clients, reads over every node",
            "",
            f"Machine: {_machine(fd)}. {fd['clients']} concurrent clients, each its own client "
            "id, publishing one ping per request to a 3-node cluster through one queue server; "
            "with server-side batching (publishes merged into one append op per topic while "
            "the leader persists) and without (`--no-merge-publishes`: one op per publish, "
            "still many ops per Raft entry).",
            "",
            "| API | server-side batching | pings/s | p50 / p99 ms |",
            "| --- | --- | ---: | ---: |",
        ]
        for c in fd["single_pings"]:
            lines.append(
                f"| {c['api']} | {'on' if c['server_side_batching'] else 'off'} "
                f"| {c['pings_per_s']:,.0f} | {c['ack_p50_ms']} / {c['ack_p99_ms']} |"
            )
        lines += [
            "",
            f"Reads: {fd['readers']} concurrent fenced fetches of 100 pings, served by whichever "
            "node steals them from the queue server.",
            "",
            "| nodes | reads/s | p50 / p99 ms | share of reads per node |",
            "| ---: | ---: | ---: | --- |",
        ]
        for c in fd["reads"]:
            share = ", ".join(f"node {n}: {v:.0%}" for n, v in c["share_by_node"].items())
            lines.append(
                f"| {c['nodes']} | {c['reads_per_s']:,.0f} | {c['ack_p50_ms']} / "
                f"{c['ack_p99_ms']} | {share} |"
            )
        lines += [
            "",
            "Reads spread over every node, but on this 2-core machine three nodes do not read "
            "faster than one: the cores, not the nodes, are the limit, and three processes "
            "also share them with the queue server and the client. On separate hosts each "
            "node adds its own cores.",
            "",
        ]
    dc = _load("discovery")
    if dc:
        f3, f5, j = dc["formation"]["3"], dc["formation"]["5"], dc["join"]
        lines += [
            "## Cold start by discovery",
            "",
            f"Machine: {_machine(dc)}. Hosts are network namespaces on a bridge; nodes know "
            "only the cluster name and the secret and broadcast signed HELLOs every second.",
            "",
            "| nodes | trials | last start to one ready cluster, median s | max s |",
            "| ---: | ---: | ---: | ---: |",
            f"| 3 | {f3['trials']} | {f3['median_s']} | {f3['max_s']} |",
            f"| 5 | {f5['trials']} | {f5['median_s']} | {f5['max_s']} |",
            "",
            f"A node joining a cluster that holds {j['gb']} GB of pings became a voter "
            f"{j['to_voter_s']} s after it started (learner, caught up, promoted). Most of the "
            "formation time is the founding rule's deliberate waits: a stable view for two "
            "intervals, then an agreement held for two more, then each newcomer's join and "
            "promotion, one configuration change at a time.",
            "",
        ]
    sp = _load("spark_heatmap")
    if sp:
        lines += [
            "## Heat maps on Spark",
            "",
            f"Machine: {_machine(sp)}. One node; the job reads through the roadlog data source, "
            "maps to H3, aggregates, commits the result into the cluster and writes Parquet, "
            "GeoJSON, PNG and HTML.",
            "",
            "| pings | master | job s | pings/s | cells |",
            "| ---: | --- | ---: | ---: | ---: |",
        ]
        for jb in sp["jobs"]:
            lines.append(
                f"| {jb['pings']:,} | {jb['master']} | {jb['seconds']} | {jb['pings_per_s']:,} "
                f"| {jb['cells']:,} |"
            )
        rd = sp["read"]
        lines += [
            "",
            f"H3 mapping (h3ronpy, vectorised): {sp['h3_points_per_s']:,} points/s. Reading "
            f"{rd['rows']:,} pings through the data source (count and mean) took "
            f"{rd['source_s']} s "
            f"against {rd['parquet_s']} s from Parquet: {rd['ratio_source_to_parquet_time']}x "
            "the time (the source decodes stored batches into Arrow in Python tasks and streams "
            "them over gRPC; Parquet is read by the JVM).",
            "",
        ]
    sd = _load("stream_delay")
    if sd:
        lines += [
            "## Streaming heat maps: a ping acknowledged to its cell on the page",
            "",
            f"Machine: {_machine(sd)}. `bench/stream_delay.py`: 3 nodes and a queue server "
            "(TLS, tokens), `roadlog heatmap stream munich --every Ns --window 15m` (Spark "
            f"local[2], its own process), {sd['background_pings_per_s']} background pings/s, the "
            "dashboard open in headless Chromium (it polls the heat map's ETag every "
            f"{sd['poll_ms'] / 1000:g} s). Each probe is one ping in a cell no other ping "
            "touches, sent at a random point of the trigger interval: from its acknowledgement "
            "to the heat map that holds it being committed, and to its cell on the page.",
            "",
            "| trigger every | probes | ack to page s: min | median | max "
            "| median ack to commit s | trigger's work s: median | max |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for run in sd["runs"]:
            d, tr = run["ack_to_page_s"], run["trigger_seconds"]
            commit = statistics.median(p["ack_to_commit_s"] for p in run["probes"])
            lines.append(
                f"| {run['every_s']} s | {len(run['probes'])} | {d['min']} | {d['median']} "
                f"| {d['max']} | {round(commit, 2)} | {tr['median']} | {tr['max']} |"
            )
        lines.append("")
    fo = _load("failover")
    if fo:
        r, j, cu = fo["roadlog"], fo["jetstream"], fo["catch_up"]
        lines += [
            "## Failover and catch-up",
            "",
            f"Machine: {_machine(fo)}. SIGKILL of the leader (for JetStream: of the stream "
            "leader's server) while a writer publishes 100-ping batches back to back; the pause "
            "runs from the kill to the first acknowledgment of a request sent after it.",
            "",
            "| system | trials | median ms | max ms |",
            "| --- | ---: | ---: | ---: |",
            f"| roadlog | {r['trials']} | {r['median_ms']} | {r['max_ms']} |",
            f"| JetStream | {j['trials']} | {j['median_ms']} | {j['max_ms']} |",
            "",
            f"Median ratio roadlog/JetStream: {fo['median_ratio']}. Catch-up of a wiped node "
            f"after {cu['pings']:,} pings: {cu['snapshot_mb']} MB snapshot in {cu['seconds']} s, "
            f"{cu['mb_per_s']} MB/s; replicas identical afterwards: {cu['identical']}.",
            "",
        ]
    sim = _load("simulation")
    if sim:
        lines += [
            "## Deterministic simulation",
            "",
            f"Machine: {_machine(sim)}. `make sim SEEDS={sim['seeds']} START={sim['start']}`: "
            f"{sim['seeds']:,} seeds, {sim['violations']} violations, {sim['seconds']:.0f} s "
            f"on {sim['jobs']} processes.",
            "",
        ]
    return "\n".join(lines)


Section = tuple[str, str, list[tuple[str, str]]]  # title, text before its ###, its ### parts


def _sections(doc: str) -> tuple[str, list[Section]]:
    """A document's text before its first ``## `` heading, and its ``## ``
    sections, each split into its text before its first ``### `` heading
    and its ``### `` parts (title line, whole text)."""
    head, *chunks = ("\n" + doc).split("\n## ")
    out: list[Section] = []
    for chunk in chunks:
        title, _, body = chunk.partition("\n")
        intro, *parts = ("\n" + body).split("\n### ")
        out.append((title, intro, [(p.partition("\n")[0], "\n### " + p) for p in parts]))
    return head.removeprefix("\n"), out


def keep_written(generated: str, existing: str) -> str:
    """``generated`` with what was written by hand in ``existing`` kept: the
    ``### `` parts of a section that the report does not write (runs
    recorded with their commit and what they showed), after the section's
    own, and whole sections it does not write, after the section they
    followed. What the report writes replaces its own older text."""
    head, new = _sections(generated)
    _, old = _sections(existing)
    made = {title for title, _, _ in new}
    old_parts = {title: parts for title, _, parts in old}
    after: dict[str | None, list[Section]] = {}
    previous: str | None = None
    for sec in old:
        if sec[0] in made:
            previous = sec[0]
        else:
            after.setdefault(previous, []).append(sec)

    def text(sec: Section) -> str:
        title, intro, parts = sec
        return "\n## " + title + intro + "".join(p for _, p in parts)

    old_intros = {title: intro for title, intro, _ in old}
    out = [head.rstrip("\n") + "\n"]
    out += [text(s) for s in after.get(None, [])]
    for title, intro, parts in new:
        mine = {t for t, _ in parts}
        kept = [(t, p) for t, p in old_parts.get(title, []) if t not in mine]
        intro = _with_written(intro, old_intros.get(title, ""))
        out.append(text((title, intro, parts + kept)))
        out += [text(s) for s in after.get(title, [])]
    return "".join(out).rstrip("\n") + "\n"


def _kind(paragraph: str) -> str:
    """What a paragraph is, for telling an older version of a generated one
    (a "Machine:" line, a table, a ratios line) from one written by hand:
    its first line's label up to a colon early in it, else the line's first
    30 characters (a table: its header)."""
    first = paragraph.strip().split("\n", 1)[0]
    label, colon, _ = first[:40].partition(":")
    return label if colon else first[:30]


def _with_written(intro: str, old: str) -> str:
    """A section's generated text, then the paragraphs of its ``old`` text
    that are no version of a generated one (written by hand), in order."""
    kinds = {_kind(p) for p in intro.split("\n\n") if p.strip()}
    written = [p for p in old.split("\n\n") if p.strip() and _kind(p) not in kinds]
    if not written:
        return intro
    return intro.rstrip("\n") + "\n\n" + "\n\n".join(w.strip("\n") for w in written) + "\n"


def main() -> int:
    existing = OUT.read_text() if OUT.exists() else ""
    OUT.write_text(keep_written(render(), existing))
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
