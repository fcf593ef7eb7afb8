"""Verification throughput: records/s of ``ztate verify`` against a hashing floor.

The issue's target: verify 100,000 stored transitions at no less than half the
rate at which the same run can merely recompute what every record needs at
least, its SHA-256 and its HMAC. The ledger is built without the transition
service, with the service's own pieces: ``ztate.contract.record.seal`` under the run's
keyring, the default policy's digest, patches by the policy's four nodes in
turn (``THREADS`` threads of ``VERSIONS`` records, each keeping its state body),
and loaded with ``COPY`` into the run's own database. Then, in interleaved
rounds, the best of each counting:

* **floor**: ``sha256`` of every stored record's bytes and the HMAC of that
  digest under its key, in a tight loop over bytes already in memory (read from
  the bundle before the timing starts);
* **database**: ``ztate.services.verify.checks.verify_database`` over the whole ledger (one
  snapshot, streamed from Postgres), every check on;
* **bundle**: ``ztate.services.verify.bundle.verify_bundle`` over the ledger exported once
  with ``ztate.services.verify.bundle.export_bundle`` (no database);
* both as ``ztate verify`` runs them (the compiled lane, ``services/verify/_chain.c``,
  taking the rows it confirms) and with the reference alone (``--reference-only``);
* **database rows fetched**: verify_database's query read and decoded by asyncpg,
  nothing checked: what the database source costs before any check;
* both again on worker processes (``ztate verify --jobs 1`` and ``--jobs 2``,
  ``ztate.services.verify.parallel``), the floor staying one core's.

Each verifier runs in a fresh process (``python -m bench.verify``), as a user runs
``ztate verify``: forked from this process, which holds the ledger it built, the
``--jobs`` workers spent up to twice the CPU per record. The floor runs in a fresh
process too: timed in this one it moved between runs (2.5 to 3.8 µs a record) more
than the verifiers did. Each measurement reports its
wall rate and its CPU per record: of ztate (the verifying process and the workers it
reaped, ``getrusage``, around the verification alone: not the interpreter's start)
and of Postgres (the postmaster's tree, ``bench.cpu``). On a machine shared with other work the wall
rates move with the load; CPU per record hardly does, so the per-core target is
judged on it: the floor's CPU per record over the verifier's. The CPU the rest of
the machine used during the rounds is printed with the figures.

Every verification must find nothing: a finding aborts the run, since a
verifier that is fast because it stopped checking is no result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import orjson

from bench.cpu import CpuMeter, children_count, children_settled, process_tree, whole_machine
from bench.workload import (
    DEFAULT_POLICY,
    INITIAL_STATE,
    OPERATOR_NAME,
    TRANSITION_COLUMNS,
    TRUST_DOMAIN,
    receipt_patch,
)
from ztate.contract.canonical import JsonObject, canonical_bytes, orjson_canonical, sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.record import (
    GENESIS_PARENT,
    KIND_GENESIS,
    KIND_TRANSITION,
    build_record,
    seal,
    sign_digest,
)
from ztate.services.policy.changes import apply_patch
from ztate.services.policy.model import Policy, PolicySet
from ztate.services.runtime.identity import Identity, Role
from ztate.services.verify.bundle import RECORDS, export_bundle, verify_bundle
from ztate.services.verify.checks import (
    ALL_ROWS,
    PREFETCH,
    Finding,
    Summary,
    Trust,
    verify_database,
)
from ztate.services.verify.parallel import verify_bundle_parallel, verify_database_parallel

THREADS = 1_000
VERSIONS = 100
ROUNDS = 3
TARGET = 0.5  # verification >= half the floor

THREAD_COLUMNS = ("thread_id", "version", "head_digest", "state", "policy_name", "policy_digest")
NODES = ("input-parser", "planner", "approval-gate", "db-writer")
EPOCH = datetime(2026, 11, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Ledger:
    """What was loaded: the record bytes (for the floor), the first ``DESIGN_SAMPLE``
    state bodies (for the design's floor) and the sizes."""

    records: list[bytes]
    states: list[bytes]
    record_bytes: int
    state_bytes: int


@dataclass(frozen=True)
class Round:
    """One measurement in one round: wall rate, and CPU seconds per record of ztate's
    processes (this one and the workers it reaped) and of Postgres."""

    rate: float
    cpu: float
    postgres: float


@dataclass(frozen=True)
class VerifyFigures:
    records: int
    measured: dict[str, list[Round]]  # by measurement, one per round
    record_bytes: int
    state_bytes: int
    others: float  # CPU seconds/s the rest of the machine used during the rounds
    cores: int

    def lines(self) -> list[str]:
        mean_record = self.record_bytes / self.records
        mean_state = self.state_bytes / self.records
        best = {name: max(r.rate for r in rounds) for name, rounds in self.measured.items()}
        # CPU per record: the least of the rounds (contention adds CPU, never removes it)
        cpu = {name: min(r.cpu for r in rounds) for name, rounds in self.measured.items()}
        pg = {name: min(r.postgres for r in rounds) for name, rounds in self.measured.items()}
        floor, floor_cpu = best[FLOOR], cpu[FLOOR]
        out = [
            f"verification of {self.records:,} stored transitions ({THREADS:,} threads x "
            f"{VERSIONS} versions; records {mean_record:,.0f} B, state bodies "
            f"{mean_state:,.0f} B on average), best of {ROUNDS} interleaved rounds; the "
            f"rest of the machine used {self.others:.2f} of its {self.cores} cores meanwhile",
            "",
            "| measurement | records/s | / floor | ztate CPU µs/record | / floor per core "
            "| Postgres CPU µs/record | records/s by round |",
            "|---|--:|--:|--:|--:|--:|--:|",
        ]
        for name, rounds in self.measured.items():
            by_round = " / ".join(f"{r.rate:,.0f}" for r in rounds)
            out.append(
                f"| {name} | {best[name]:,.0f} | {best[name] / floor:.3f} | "
                f"{cpu[name] * 1e6:.1f} | {floor_cpu / cpu[name]:.3f} | "
                f"{pg[name] * 1e6:.1f} | {by_round} |"
            )
        per_core = min(floor_cpu / cpu[name] for name in ("verify_database", "verify_bundle"))
        verdict = "met" if per_core >= TARGET else "NOT met"
        out.append(
            f"target: verification >= {TARGET} x the floor per core (CPU per record, "
            f"one process, database and bundle): {per_core:.3f} -> {verdict}"
        )
        gains = ", ".join(
            f"{source} {cpu[f'verify_{source} {REFERENCE}'] / cpu[f'verify_{source}']:.2f}x"
            for source in ("database", "bundle")
        )
        out.append(
            f"the compiled lane against the reference alone, CPU per record: {gains}; the "
            f"reference's compiled calls alone cost {cpu[DESIGN] * 1e6:.1f} µs a record "
            f"({DESIGN_SAMPLE:,} records), so the reference, whatever its Python, gets no "
            f"higher than {floor_cpu / cpu[DESIGN]:.3f} x the floor per core"
        )
        fetched, checked = cpu[FETCH], cpu["verify_database"] - cpu[FETCH]
        out.append(
            f"from a database, asyncpg reading the rows alone costs {fetched * 1e6:.1f} µs a "
            f"record ({floor_cpu / fetched:.2f} x the floor's CPU), the checks "
            f"{checked * 1e6:.1f} more; a bundle's whole run {cpu['verify_bundle'] * 1e6:.1f}"
        )
        for source in ("database", "bundle"):
            one, two = f"{source} --jobs 1", f"{source} --jobs 2"
            out.append(
                f"--jobs scaling, {source}: --jobs 2 / --jobs 1 = {best[two] / best[one]:.2f} "
                f"x the records/s (2.00 is linear on two free cores), CPU per record "
                f"{cpu[two] / cpu[one]:.2f} x (1.00: parallel work costs nothing extra)"
            )
        return out


FLOOR = "floor: sha256 + HMAC"
DESIGN = "the reference's compiled calls"
REFERENCE = "--reference-only"
FETCH = "database rows fetched, nothing checked"
DESIGN_SAMPLE = 10_000  # records the design's floor runs over (its state bodies are kept)


def _patch(node: str, version: int) -> JsonObject:
    """What each node of the default policy writes, as a pipeline run would."""
    order = f"ORD-{version:05d}"
    action = {"action": "refund", "order_id": order, "amount_cents": 100 * version}
    if node == "input-parser":
        return {"requested_action": action}
    if node == "planner":
        return {"pending_transition": action | {"reason": "the customer asked for a refund"}}
    if node == "approval-gate":
        return {"approved_action": action} | receipt_patch(384)
    return {"result_ref": f"orders://{order}/refund"}


def _thread_rows(
    thread_id: str, keyring: Keyring, policy: Policy
) -> Iterator[tuple[tuple[Any, ...], bytes, bytes]]:
    """The thread's transition rows (COPY tuples), with record and state bytes."""
    operator = Identity(TRUST_DOMAIN, Role.OPERATOR, OPERATOR_NAME).spiffe_id
    state: JsonObject = {}
    parent = GENESIS_PARENT
    for version in range(VERSIONS):
        if version == 0:
            kind, node_id, patch = KIND_GENESIS, operator, dict(INITIAL_STATE)
        else:
            node = NODES[(version - 1) % len(NODES)]
            kind, patch = KIND_TRANSITION, _patch(node, version)
            node_id = Identity(TRUST_DOMAIN, Role.NODE, node).spiffe_id
        state = apply_patch(state, patch)
        state_bytes = canonical_bytes(state)
        committed_at = EPOCH + timedelta(seconds=version)
        sealed = seal(
            build_record(
                kind=kind,
                thread_id=thread_id,
                version=version,
                parent_digest=parent,
                node_id=node_id,
                patch=patch,
                state_digest=sha256_hex(state_bytes),
                policy_digest=policy.digest,
                receipt_digest=None,
                key_id=keyring.current,
                committed_at=committed_at,
            ),
            keyring,
        )
        row = (
            thread_id,
            version,
            sealed.digest,
            parent,
            node_id,
            sealed.key_id,
            sealed.signature,
            sealed.record_bytes,
            state_bytes,
            committed_at,
        )
        yield row, sealed.record_bytes, state_bytes
        parent = sealed.digest


async def load_ledger(dsn: str, keyring: Keyring, policy: Policy) -> Ledger:
    """Seal and COPY ``THREADS`` x ``VERSIONS`` transitions into the database."""
    transitions: list[tuple[Any, ...]] = []
    threads: list[tuple[Any, ...]] = []
    records: list[bytes] = []
    states: list[bytes] = []
    state_total = 0
    for number in range(THREADS):
        thread_id = f"bench-verify-{number:05d}"
        last: tuple[Any, ...] = ()
        for row, record, state in _thread_rows(thread_id, keyring, policy):
            transitions.append(row)
            records.append(record)
            if len(states) < DESIGN_SAMPLE:
                states.append(state)
            state_total += len(state)
            last = row
        threads.append((thread_id, last[1], last[2], last[8], policy.name, policy.digest))
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.copy_records_to_table(
                "threads", schema_name="ztate", records=threads, columns=THREAD_COLUMNS
            )
            await conn.copy_records_to_table(
                "transitions", schema_name="ztate", records=transitions, columns=TRANSITION_COLUMNS
            )
        await conn.execute("ANALYZE ztate.threads; ANALYZE ztate.transitions")
    finally:
        await conn.close()
    return Ledger(records, states, sum(len(r) for r in records), state_total)


def floor_count(records: list[bytes], keyring: Keyring) -> int:
    """Recompute each record's SHA-256 and the HMAC of that digest, by the fastest
    calls the standard library has (one-shot, no hex); the records done."""
    key = keyring.key(keyring.current)
    sha256, hmac_digest = hashlib.sha256, hmac.digest
    for record in records:
        hmac_digest(key, sha256(record).digest(), "sha256")
    return len(records)


def design_calls(records: list[bytes], states: list[bytes], keyring: Keyring) -> Callable[[], int]:
    """What the reference verifier (checks.py, ``--reference-only``) calls into compiled
    code for every record, and nothing else (no Python check between the calls): the
    record's SHA-256 and HMAC, its parse (orjson) and canonical check (orjson writing
    it again), the replayed state written in canonical form (orjson) and hashed.
    However fast its Python glue, the reference costs at least this per record; the
    compiled lane checks the canonical form while it scans and replays on the bytes.
    Over the first ``DESIGN_SAMPLE`` records, their states parsed beforehand."""
    key = keyring.key(keyring.current)
    replayed = [orjson.loads(state) for state in states]
    sample = records[: len(states)]

    def run() -> int:
        for record, state in zip(sample, replayed, strict=True):
            sign_digest(key, sha256_hex(record))
            orjson_canonical(record, orjson.loads(record))
            sha256_hex(orjson.dumps(state, option=orjson.OPT_SORT_KEYS))
        return len(sample)

    return run


def _refuse(finding: Finding) -> None:
    raise RuntimeError(f"the benchmark ledger does not verify: {finding}")


def _ztate_cpu() -> float:
    """CPU seconds of this process and of the children it has reaped (the workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True)
class Timed:
    """One verification: the records verified, its wall seconds and its CPU seconds
    (of the verifying process and the workers it reaped)."""

    records: int
    wall: float
    cpu: float


async def _timed(
    count: int, postgres: CpuMeter, postmaster: int | None, run: Callable[[], Awaitable[Timed]]
) -> Round:
    backends = children_count(postmaster) if postmaster is not None else 0
    pg = postgres()
    timed = await run()
    if timed.records != count:
        raise RuntimeError(f"verified {timed.records} records of {count}")
    if postmaster is not None:  # the run's backends counted once they are reaped
        children_settled(postmaster, backends)
    return Round(count / timed.wall, timed.cpu / count, (postgres() - pg) / count)


def verify_here(
    source: str, location: str, keyring_file: Path, jobs: int, reference_only: bool = False
) -> Timed:
    """Verify the benchmark's ledger in this process (``jobs`` 0) or on ``jobs``
    workers forked from it, as ``ztate verify`` does: ``source`` is ``database`` (a
    DSN) or ``bundle`` (a folder); ``reference_only`` as ``--reference-only``. Any
    finding raises."""
    keyring = Keyring.load(keyring_file, None)
    policies = PolicySet([Policy.load(DEFAULT_POLICY)])
    trust = Trust(keyring, {}, policies, reference_only=reference_only)
    records = _bundle_records(Path(location)) if source == FLOOR else []
    cpu, started = _ztate_cpu(), time.perf_counter()
    if source == FLOOR:
        summary = Summary(records=floor_count(records, keyring))
    elif source == FETCH:
        summary = Summary(records=asyncio.run(fetch_rows(location)))
    elif source == "database" and jobs == 0:
        summary = asyncio.run(verify_database(location, trust, _refuse))
    elif source == "database":
        summary = asyncio.run(verify_database_parallel(location, trust, _refuse, jobs=jobs))
    elif jobs == 0:
        summary = verify_bundle(Path(location), trust, _refuse)
    else:
        summary = verify_bundle_parallel(Path(location), trust, _refuse, jobs=jobs)
    return Timed(summary.records, time.perf_counter() - started, _ztate_cpu() - cpu)


def _bundle_records(bundle: Path) -> list[bytes]:
    """The record bytes of a bundle's ``records.jsonl``, for the floor to hash."""
    with (bundle / RECORDS).open("rb") as lines:
        return [orjson.loads(line)["record"].encode() for line in lines]


async def fetch_rows(dsn: str) -> int:
    """What verify_database reads, and nothing more: its query, in its snapshot and its
    batches, each row decoded by asyncpg and dropped; the rows read."""
    conn = await asyncpg.connect(dsn)
    try:
        count = 0
        async with conn.transaction(readonly=True, isolation="repeatable_read"):
            cursor = await conn.cursor(ALL_ROWS)
            while rows := await cursor.fetch(PREFETCH):
                count += len(rows)
        return count
    finally:
        await conn.close()


async def _in_a_process(
    source: str, location: str, keyring_file: Path, jobs: int, reference_only: bool
) -> Timed:
    """``verify_here`` in a fresh process, as a user runs ``ztate verify``: its workers
    fork from a small process, not from this one, which holds the ledger it built
    (workers forked from it spent up to 2x the CPU per record)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.verify",
        source,
        location,
        str(keyring_file),
        str(jobs),
        REFERENCE if reference_only else "",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"verifying the {source} failed: {err.decode(errors='replace')}")
    return Timed(**json.loads(out))


async def measure_verification(
    dsn: str,
    root: Path,
    keyring_file: Path,
    progress: Callable[[str], None],
    postmaster: int | None = None,
) -> VerifyFigures:
    """Load the ledger, export it once, then the floor and the verifiers in rounds,
    each verifier in a process of its own."""
    keyring = Keyring.load(keyring_file, None)
    policy = Policy.load(DEFAULT_POLICY)
    progress(f"verify: sealing and loading {THREADS * VERSIONS:,} transitions")
    ledger = await load_ledger(dsn, keyring, policy)
    bundle = root / "verify-bundle"
    progress("verify: exporting the bundle")
    await export_bundle(dsn, bundle)
    count = len(ledger.records)
    meter: CpuMeter = process_tree(postmaster) if postmaster is not None else (lambda: 0.0)

    def here(run: Callable[[], int]) -> Callable[[], Awaitable[Timed]]:
        async def timed() -> Timed:
            cpu, started = _ztate_cpu(), time.perf_counter()
            records = run()
            return Timed(records, time.perf_counter() - started, _ztate_cpu() - cpu)

        return timed

    def verifier(
        source: str, jobs: int, reference_only: bool = False
    ) -> Callable[[], Awaitable[Timed]]:
        location = str(bundle) if source in ("bundle", FLOOR) else dsn
        return lambda: _in_a_process(source, location, keyring_file, jobs, reference_only)

    runs: dict[str, Callable[[], Awaitable[Timed]]] = {
        # the floor too in a fresh process, as the verifiers: timed in this one, which
        # holds the whole ledger, it moved between runs more than they did
        FLOOR: verifier(FLOOR, 0),
        DESIGN: here(design_calls(ledger.records, ledger.states, keyring)),
        "verify_database": verifier("database", 0),
        "verify_bundle": verifier("bundle", 0),
        f"verify_database {REFERENCE}": verifier("database", 0, reference_only=True),
        f"verify_bundle {REFERENCE}": verifier("bundle", 0, reference_only=True),
        FETCH: verifier(FETCH, 0),
        "database --jobs 1": verifier("database", 1),
        "database --jobs 2": verifier("database", 2),
        "bundle --jobs 1": verifier("bundle", 1),
        "bundle --jobs 2": verifier("bundle", 2),
    }
    measured: dict[str, list[Round]] = {name: [] for name in runs}
    machine, ours, started = whole_machine(), _ztate_cpu(), time.perf_counter()
    pg_start = meter()
    for number in range(1, ROUNDS + 1):
        progress(f"verify: round {number} of {ROUNDS}")
        for name, run in runs.items():
            expected = len(ledger.states) if name == DESIGN else count
            measured[name].append(await _timed(expected, meter, postmaster, run))
    elapsed = time.perf_counter() - started
    used = (whole_machine() - machine) - (_ztate_cpu() - ours) - (meter() - pg_start)
    return VerifyFigures(
        count,
        measured,
        ledger.record_bytes,
        ledger.state_bytes,
        max(0.0, used / elapsed),
        os.cpu_count() or 1,
    )


if __name__ == "__main__":  # one verification, for _in_a_process: its figures as JSON
    source, location, keyring_file, jobs, reference = sys.argv[1:]
    timed = verify_here(source, location, Path(keyring_file), int(jobs), reference == REFERENCE)
    print(json.dumps(dataclasses.asdict(timed)))
