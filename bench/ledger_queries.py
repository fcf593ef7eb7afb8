"""Operator query latency on a ledger of a million transitions, and what the
query indexes cost a commit.

The issue asks that operator queries on a million transitions answer in
milliseconds. Going through gRPC to build such a ledger would take hours, so the
ledger is written straight into the run's own database with ``COPY``: realistic
canonical records (the record format of docs/ledger-format.md, patches by the
default policy's four nodes in turn, a rare permissions change, each record's
real SHA-256 digest and an HMAC-SHA256 of it), ``THREADS`` threads of
``VERSIONS`` versions committed over a month, state bodies kept for the last
``KEPT_STATES`` versions of each thread (as after retention), and some parked
proposals in every status. Triggers are off while loading (a superuser's
``session_replication_role``), so the loader writes the ``ztate.transition_keys``
rows the insert trigger would; the 0007 indexes on ``ztate.transitions`` are
built after the load, which is how a bulk load is done anyway.

Then every query shape of ``ztate.services.store.ledger.LedgerQueries`` runs on the
read-only role, ``SAMPLES`` times each with varying arguments after a warm-up,
and the report gives p50 and p99 in milliseconds. Last, the commit cost:
sequential single-statement commits (the transition store's own ``COMMIT``) on
the loaded ledger with migration 0007 (its indexes and the key-table trigger), then without.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from bench.workload import TRANSITION_COLUMNS
from ztate.services.store.ledger import (
    LedgerQueries,
    PageKey,
    TransitionFilter,
)
from ztate.services.store.transitions import COMMIT

THREADS = 10_000
VERSIONS = 100  # THREADS x VERSIONS = 1,000,000 transitions
KEPT_STATES = 10
PARKED = 20_000
SAMPLES = 200
WARMUP = 20
COMMITS = 2_000
BATCH = 50_000
TRUST_DOMAIN = "bench.ztate"
NODES = ("input-parser", "planner", "approval-gate", "db-writer")
EPOCH = datetime(2026, 10, 1, tzinfo=UTC)
SPAN = timedelta(days=30)
KEY = b"ledger-queries-bench-hmac-key-32b"
POLICY_DIGEST = hashlib.sha256(b"bench policy").hexdigest()
ZERO = "0" * 64
QUERY_INDEXES = ("transitions_by_time", "transitions_by_node", "transitions_by_thread_time")
STATUSES = ("pending", "rejected", "expired", "stale", "committed")


def _node(name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/node/{name}"


def _canonical(value: Any) -> bytes:
    # ASCII keys and values, integers only: sorted compact JSON is RFC 8785 here
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _thread_id(index: int) -> str:
    return f"bench-{index:06d}"


def _patch(version: int, thread: int) -> tuple[str, dict[str, Any]]:
    """Who writes at ``version`` and what: the pipeline's nodes in turn."""
    order = f"A-{thread}-{version}"
    if version % 97 == 13:
        return "approval-gate", {"execution_permissions": ["read_orders", "refund"]}
    turn = version % 4
    if turn == 1:
        return "input-parser", {"requested_action": {"action": "refund", "order_id": order}}
    if turn == 2:
        plan = {"action": "refund", "order_id": order, "amount_cents": version * 100}
        return "planner", {"pending_transition": plan}
    if turn == 3:
        approved = {"action": "refund", "order_id": order, "amount_cents": version * 100}
        return "approval-gate", {"approved_action": approved}
    return "db-writer", {"result_ref": f"db://orders/{order}", "requested_action": None}


@dataclass(frozen=True)
class Loaded:
    seconds: float
    digests: list[str]  # a sample of committed digests
    # (thread, version, digest) of each head
    heads: list[tuple[str, int, str]]


def _moment(thread: int, version: int) -> datetime:
    step = SPAN / (THREADS * VERSIONS)
    return EPOCH + step * (version * THREADS + thread)


def _thread_rows(
    thread: int, sample: list[str], keys: list[tuple[Any, ...]]
) -> Iterator[tuple[Any, ...]]:
    """One thread's transitions, in version order; their ztate.transition_keys rows
    go to ``keys`` (the insert trigger is off while loading)."""
    thread_id = _thread_id(thread)
    state: dict[str, Any] = {
        "authority": {"tenant": "acme"},
        "raw_text": f"please refund order A-{thread}",
        "target_user_id": str(uuid.UUID(int=thread, version=4)),
    }
    parent = ZERO
    for version in range(VERSIONS):
        if version == 0:
            node, patch = f"spiffe://{TRUST_DOMAIN}/operator/alice", dict(state)
        else:
            name, patch = _patch(version, thread)
            node = _node(name)
            for key, value in patch.items():
                if value is None:
                    state.pop(key, None)
                else:
                    state[key] = value
        state_bytes = _canonical(state)
        committed_at = _moment(thread, version)
        record = _canonical(
            {
                "format": 1,
                "kind": "genesis" if version == 0 else "transition",
                "thread_id": thread_id,
                "version": version,
                "parent_digest": parent,
                "node_id": node,
                "patch": patch,
                "state_digest": hashlib.sha256(state_bytes).hexdigest(),
                "policy_digest": POLICY_DIGEST,
                "receipt_digest": None,
                "key_id": "bench-k1",
                "committed_at": _stamp(committed_at),
            }
        )
        digest = hashlib.sha256(record).hexdigest()
        signature = hmac.new(KEY, digest.encode(), hashlib.sha256).hexdigest()
        kept = state_bytes if version >= VERSIONS - KEPT_STATES else None
        if version == 50 and thread % 50 == 0:
            sample.append(digest)
        keys += [(key, committed_at, digest, node) for key in patch]
        yield (thread_id, version, digest, parent, node, "bench-k1", signature, record, kept,
               committed_at)  # fmt: skip
        parent = digest


def _parked_rows(heads: list[tuple[str, int, str]]) -> Iterator[tuple[Any, ...]]:
    rng = random.Random(7)
    for index in range(PARKED):
        thread_id, version, head = heads[rng.randrange(len(heads))]
        patch = {"target_user_id": str(uuid.UUID(int=index + 1, version=4))}
        proposal = _canonical(
            {"thread_id": thread_id, "base_version": version, "patch": patch, "n": index}
        )
        yield (
            hashlib.sha256(proposal).hexdigest(),
            thread_id,
            version,
            head,
            _node("planner"),
            proposal,
            b"{}",
            ["target-user-change"],
            f"parked-{index}",
            ZERO,
            STATUSES[index % len(STATUSES)],
            EPOCH + SPAN * (index / PARKED),
        )


async def load_ledger(dsn: str, progress: Callable[[str], None]) -> Loaded:
    """Write the ledger with COPY; the 0007 indexes are rebuilt after the load."""
    started = time.perf_counter()
    conn = await asyncpg.connect(dsn, server_settings={"session_replication_role": "replica"})
    try:
        for index in QUERY_INDEXES:
            await conn.execute(f"DROP INDEX ztate.{index}")
        sample: list[str] = []
        heads: list[tuple[str, int, str]] = []
        head_rows: list[tuple[Any, ...]] = []
        batch: list[tuple[Any, ...]] = []
        keys: list[tuple[Any, ...]] = []
        for thread in range(THREADS):
            last: tuple[Any, ...] = ()
            for row in _thread_rows(thread, sample, keys):
                batch.append(row)
                last = row
            heads.append((last[0], last[1], last[2]))
            head_rows.append((last[0], last[1], last[2], last[8], "pipeline", POLICY_DIGEST))
            if len(batch) >= BATCH:
                await _copy_transitions(conn, batch, keys)
                batch, keys = [], []
                progress(f"loaded {(thread + 1) * VERSIONS:,} transitions")
        await _copy_transitions(conn, batch, keys)
        await conn.copy_records_to_table(
            "threads",
            schema_name="ztate",
            columns=[
                "thread_id",
                "version",
                "head_digest",
                "state",
                "policy_name",
                "policy_digest",
            ],
            records=head_rows,
        )
        await conn.copy_records_to_table(
            "pending_transitions",
            schema_name="ztate",
            columns=[
                "digest",
                "thread_id",
                "base_version",
                "parent_digest",
                "node_id",
                "proposal",
                "state",
                "risk_rules",
                "idempotency_key",
                "request_digest",
                "status",
                "parked_at",
            ],
            records=list(_parked_rows(heads)),
        )
        progress("building the query indexes")
        await conn.execute("SET maintenance_work_mem = '256MB'")
        await conn.execute(_create_indexes())
        await conn.execute("ANALYZE ztate.transitions")
        await conn.execute("ANALYZE ztate.pending_transitions")
        await conn.execute("ANALYZE ztate.threads")
        await conn.execute("ANALYZE ztate.transition_keys")
    finally:
        await conn.close()
    return Loaded(time.perf_counter() - started, sample, heads)


def _create_indexes() -> str:
    """The 0007 index statements, as shipped (so the benchmark measures them)."""
    from importlib import resources

    text = (
        resources.files("ztate.services.store")
        .joinpath("migrations", "0007_ledger_indexes.sql")
        .read_text(encoding="utf-8")
    )
    statements = [s.strip() for s in text.split(";") if "CREATE INDEX" in s]
    transitions = [s for s in statements if "ON ztate.transitions" in s]
    lines = ["\n".join(ln for ln in s.splitlines() if not ln.startswith("--")) for s in transitions]
    return ";\n".join(lines) + ";"


async def _copy_transitions(
    conn: asyncpg.Connection, rows: list[tuple[Any, ...]], keys: list[tuple[Any, ...]]
) -> None:
    if keys:
        await conn.copy_records_to_table(
            "transition_keys",
            schema_name="ztate",
            columns=["key", "committed_at", "digest", "node_id"],
            records=keys,
        )
    if rows:
        await conn.copy_records_to_table(
            "transitions",
            schema_name="ztate",
            columns=TRANSITION_COLUMNS,
            records=rows,
        )


@dataclass(frozen=True)
class Latency:
    shape: str
    rows: float  # mean rows returned
    p50_ms: float
    p99_ms: float


async def _time(
    shape: str, call: Callable[[int], Awaitable[int]], samples: int = SAMPLES
) -> Latency:
    for i in range(WARMUP):
        await call(i)
    durations: list[float] = []
    counts: list[int] = []
    for i in range(samples):
        started = time.perf_counter()
        counts.append(await call(WARMUP + i))
        durations.append((time.perf_counter() - started) * 1000)
    durations.sort()
    p99 = durations[min(len(durations) - 1, round(0.99 * len(durations)) - 1)]
    return Latency(shape, statistics.fmean(counts), statistics.median(durations), p99)


async def measure_queries(dsn: str, loaded: Loaded, reader_role: str) -> list[Latency]:
    """Every query shape, on the read-only role, with arguments varied per call."""
    queries = await LedgerQueries.open(dsn, role=reader_role, pool_size=1)
    rng = random.Random(11)
    threads = [head[0] for head in loaded.heads]
    nodes = [_node(name) for name in NODES]
    page = 50

    def moment() -> datetime:
        return EPOCH + SPAN * rng.random()

    async def listing(where: TransitionFilter, after: PageKey | None = None) -> int:
        return len(await queries.transitions(where, limit=page, after=after))

    async def deep(where: TransitionFilter) -> int:
        # continue from a key in the middle of the ledger, as page 10,000 would
        at = moment()
        return await listing(where, PageKey(at, "f" * 64))

    async def detail_digest(i: int) -> int:
        return int(await queries.detail(digest=loaded.digests[i % len(loaded.digests)]) is not None)

    async def detail_version(_: int) -> int:
        found = await queries.detail(thread_id=rng.choice(threads), version=rng.randrange(100))
        return int(found is not None)

    async def history(_: int) -> int:
        rows = await queries.key_history(
            rng.choice(threads), "requested_action", limit=100, after_version=-1
        )
        return len(rows)

    shapes: list[tuple[str, Callable[[int], Awaitable[int]]]] = [
        ("list: newest page, no filter", lambda _: listing(TransitionFilter())),
        ("list: page deep in the ledger (keyset)", lambda _: deep(TransitionFilter())),
        (
            "list: one thread",
            lambda _: listing(TransitionFilter(thread_id=rng.choice(threads))),
        ),
        ("list: one node", lambda _: deep(TransitionFilter(node_id=rng.choice(nodes)))),
        (
            "list: changed key, common (1/4 of records)",
            lambda _: deep(TransitionFilter(changed_key="pending_transition")),
        ),
        (
            "list: changed key, rare (1%), none in 26 days",
            lambda _: listing(TransitionFilter(changed_key="execution_permissions")),
        ),
        (
            "list: node + changed key",
            lambda _: deep(
                TransitionFilter(node_id=_node("approval-gate"), changed_key="approved_action")
            ),
        ),
        (
            "list: thread + changed key",
            lambda _: listing(
                TransitionFilter(thread_id=rng.choice(threads), changed_key="requested_action")
            ),
        ),
        (
            "list: one-hour window",
            lambda _: _window(listing, moment()),
        ),
        (
            "list: parked, by status",
            lambda i: listing(TransitionFilter(status=STATUSES[i % 4])),
        ),
        ("show: by digest", detail_digest),
        ("show: by (thread, version)", detail_version),
        ("history: one key across a thread", history),
    ]
    try:
        return [await _time(shape, call) for shape, call in shapes]
    finally:
        await queries.close()


async def _window(listing: Callable[[TransitionFilter], Awaitable[int]], start: datetime) -> int:
    return await listing(TransitionFilter(since=start, until=start + timedelta(hours=1)))


@dataclass(frozen=True)
class CommitCost:
    with_indexes_us: float
    without_indexes_us: float


async def measure_commit_cost(dsn: str, service_role: str, thread_id: str) -> CommitCost:
    """Sequential one-statement commits on the loaded ledger, with and without 0007."""
    conn = await asyncpg.connect(dsn, server_settings={"role": service_role})
    admin = await asyncpg.connect(dsn)
    try:
        head = await conn.fetchrow(
            "SELECT version, head_digest FROM ztate.threads WHERE thread_id = $1", thread_id
        )
        assert head is not None
        state: dict[str, int] = {"version": head["version"]}
        digest: list[str] = [head["head_digest"]]

        async def commits(count: int) -> float:
            durations: list[float] = []
            for _ in range(count):
                version = state["version"] + 1
                patch = {"requested_action": {"action": "refund", "order_id": f"C-{version}"}}
                record = _canonical(
                    {
                        "format": 1,
                        "kind": "transition",
                        "thread_id": thread_id,
                        "version": version,
                        "parent_digest": digest[0],
                        "node_id": _node("input-parser"),
                        "patch": patch,
                    }
                )
                new = hashlib.sha256(record).hexdigest()
                started = time.perf_counter()
                await conn.fetchval(
                    COMMIT,
                    thread_id,
                    version - 1,
                    version,
                    new,
                    b'{"bench":true}',
                    digest[0],
                    _node("input-parser"),
                    "bench-k1",
                    hmac.new(KEY, new.encode(), hashlib.sha256).hexdigest(),
                    datetime.now(UTC),
                    record,
                    None,
                    None,
                    [],  # wakes no node
                    None,  # under no lease
                    None,
                )
                durations.append(time.perf_counter() - started)
                state["version"], digest[0] = version, new
            return statistics.median(durations) * 1e6

        await commits(200)
        with_indexes = await commits(COMMITS)
        for index in QUERY_INDEXES:
            await admin.execute(f"DROP INDEX ztate.{index}")
        await admin.execute("DROP TRIGGER transitions_index_keys ON ztate.transitions")
        await commits(200)
        without = await commits(COMMITS)
        return CommitCost(with_indexes, without)
    finally:
        await conn.close()
        await admin.close()


@dataclass(frozen=True)
class LedgerQueryFigures:
    loaded: Loaded
    latencies: list[Latency]
    commit: CommitCost

    def lines(self) -> list[str]:
        out = [
            f"ledger    {THREADS * VERSIONS:,} transitions ({THREADS:,} threads x {VERSIONS}), "
            f"{PARKED:,} parked proposals; loaded with COPY and indexed in "
            f"{self.loaded.seconds:.0f} s",
            f"method    LedgerQueries on the read-only role, one connection, {SAMPLES} calls "
            f"per shape after {WARMUP} warm-up, arguments varied; pages of 50",
            "",
            f"{'query shape':<46} {'rows':>6} {'p50 ms':>8} {'p99 ms':>8}",
        ]
        out += [
            f"{x.shape:<46} {x.rows:>6.1f} {x.p50_ms:>8.2f} {x.p99_ms:>8.2f}"
            for x in self.latencies
        ]
        c = self.commit
        out += [
            "",
            f"commit (p50 of {COMMITS:,} sequential commits on the loaded ledger): "
            f"{c.with_indexes_us:.0f} µs with migration 0007 (indexes, key trigger), "
            f"{c.without_indexes_us:.0f} µs without "
            f"({c.with_indexes_us - c.without_indexes_us:+.0f} µs)",
        ]
        return out


async def measure_ledger_queries(
    dsn: str, service_role: str, reader_role: str, progress: Callable[[str], None]
) -> LedgerQueryFigures:
    """Load, query, then measure the commit cost (which drops the query indexes)."""
    progress(f"loading {THREADS * VERSIONS:,} transitions with COPY")
    loaded = await load_ledger(dsn, progress)
    progress(f"loaded in {loaded.seconds:.0f} s; timing the query shapes")
    latencies = await measure_queries(dsn, loaded, reader_role)
    progress("timing commits with and without the query indexes")
    commit = await measure_commit_cost(dsn, service_role, loaded.heads[0][0])
    return LedgerQueryFigures(loaded, latencies, commit)
