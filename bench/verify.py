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
  digest under its key, in a tight loop over bytes already in memory;
* **database**: ``ztate.services.verify.checks.verify_database`` over the whole ledger (one
  snapshot, streamed from Postgres), every check on;
* **bundle**: ``ztate.services.verify.bundle.verify_bundle`` over the ledger exported once
  with ``ztate.services.verify.bundle.export_bundle`` (no database);
* both again on one worker process per core (``ztate verify --jobs 0``,
  ``ztate.services.verify.parallel``), the floor staying one core's.

Every verification must find nothing: a finding aborts the run, since a
verifier that is fast because it stopped checking is no result.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from bench.workload import (
    DEFAULT_POLICY,
    INITIAL_STATE,
    OPERATOR_NAME,
    TRANSITION_COLUMNS,
    TRUST_DOMAIN,
    receipt_patch,
)
from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.record import GENESIS_PARENT, KIND_GENESIS, KIND_TRANSITION, build_record, seal
from ztate.services.policy.changes import apply_patch
from ztate.services.policy.model import Policy, PolicySet
from ztate.services.runtime.identity import Identity, Role
from ztate.services.verify.bundle import export_bundle, verify_bundle
from ztate.services.verify.checks import Finding, Trust, verify_database
from ztate.services.verify.parallel import (
    jobs_wanted,
    verify_bundle_parallel,
    verify_database_parallel,
)

THREADS = 1_000
VERSIONS = 100
ROUNDS = 3
TARGET = 0.5  # verification >= half the floor

THREAD_COLUMNS = ("thread_id", "version", "head_digest", "state", "policy_name", "policy_digest")
NODES = ("input-parser", "planner", "approval-gate", "db-writer")
EPOCH = datetime(2026, 11, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Ledger:
    """What was loaded: the record bytes (for the floor) and the sizes."""

    records: list[bytes]
    record_bytes: int
    state_bytes: int


@dataclass(frozen=True)
class VerifyFigures:
    records: int
    floor: list[float]  # records/s, one per round
    database: list[float]
    bundle: list[float]
    database_jobs: list[float]
    bundle_jobs: list[float]
    jobs: int
    record_bytes: int
    state_bytes: int

    def lines(self) -> list[str]:
        best = {name: max(rates) for name, rates in self.rates().items()}
        mean_record = self.record_bytes / self.records
        mean_state = self.state_bytes / self.records
        out = [
            f"verification of {self.records:,} stored transitions ({THREADS:,} threads x "
            f"{VERSIONS} versions; records {mean_record:,.0f} B, state bodies "
            f"{mean_state:,.0f} B on average), best of {ROUNDS} interleaved rounds",
            "",
            "| measurement | records/s | / floor | records/s by round |",
            "|---|--:|--:|--:|",
        ]
        for name, rates in self.rates().items():
            ratio = best[name] / best["floor: sha256 + HMAC"]
            by_round = " / ".join(f"{rate:,.0f}" for rate in rates)
            out.append(f"| {name} | {best[name]:,.0f} | {ratio:.3f} | {by_round} |")
        floor = best["floor: sha256 + HMAC"]
        for label, names in (
            ("one process", ("verify_database", "verify_bundle")),
            (f"{self.jobs} workers", (f"{n} --jobs {self.jobs}" for n in ("database", "bundle"))),
        ):
            ratio = min(best[name] for name in names) / floor
            verdict = "met" if ratio >= TARGET else "NOT met"
            out.append(
                f"target: verification >= {TARGET} x the floor, {label}: {ratio:.3f} -> {verdict}"
            )
        return out

    def rates(self) -> dict[str, list[float]]:
        return {
            "floor: sha256 + HMAC": self.floor,
            "verify_database": self.database,
            "verify_bundle": self.bundle,
            f"database --jobs {self.jobs}": self.database_jobs,
            f"bundle --jobs {self.jobs}": self.bundle_jobs,
        }


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
    state_total = 0
    for number in range(THREADS):
        thread_id = f"bench-verify-{number:05d}"
        last: tuple[Any, ...] = ()
        for row, record, state in _thread_rows(thread_id, keyring, policy):
            transitions.append(row)
            records.append(record)
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
    return Ledger(records, sum(len(r) for r in records), state_total)


def floor_rate(records: list[bytes], keyring: Keyring) -> float:
    """Records/s of recomputing each record's SHA-256 and the HMAC of that digest,
    by the fastest calls the standard library has (one-shot, no hex)."""
    key = keyring.key(keyring.current)
    sha256, hmac_digest = hashlib.sha256, hmac.digest
    started = time.perf_counter()
    for record in records:
        hmac_digest(key, sha256(record).digest(), "sha256")
    return len(records) / (time.perf_counter() - started)


def _refuse(finding: Finding) -> None:
    raise RuntimeError(f"the benchmark ledger does not verify: {finding}")


async def measure_verification(
    dsn: str, root: Path, keyring: Keyring, progress: Callable[[str], None]
) -> VerifyFigures:
    """Load the ledger, export it once, then the floor and both verifiers in rounds."""
    policy = Policy.load(DEFAULT_POLICY)
    progress(f"verify: sealing and loading {THREADS * VERSIONS:,} transitions")
    ledger = await load_ledger(dsn, keyring, policy)
    trust = Trust(keyring, {}, PolicySet([policy]))
    bundle = root / "verify-bundle"
    progress("verify: exporting the bundle")
    await export_bundle(dsn, bundle)
    count = len(ledger.records)
    floor: list[float] = []
    database: list[float] = []
    bundled: list[float] = []
    database_jobs: list[float] = []
    bundle_jobs: list[float] = []
    jobs = jobs_wanted(0)
    for number in range(1, ROUNDS + 1):
        progress(f"verify: round {number} of {ROUNDS}")
        floor.append(floor_rate(ledger.records, keyring))
        started = time.perf_counter()
        summary = await verify_database(dsn, trust, _refuse)
        database.append(summary.records / (time.perf_counter() - started))
        started = time.perf_counter()
        summary_b = verify_bundle(bundle, trust, _refuse)
        bundled.append(summary_b.records / (time.perf_counter() - started))
        started = time.perf_counter()
        summary_p = await verify_database_parallel(dsn, trust, _refuse, jobs=jobs)
        database_jobs.append(summary_p.records / (time.perf_counter() - started))
        started = time.perf_counter()
        summary_q = verify_bundle_parallel(bundle, trust, _refuse, jobs=jobs)
        bundle_jobs.append(summary_q.records / (time.perf_counter() - started))
        verified = (summary.records, summary_b.records, summary_p.records, summary_q.records)
        if verified != (count,) * 4:
            raise RuntimeError(f"verified {verified} records of {count}")
    return VerifyFigures(
        count,
        floor,
        database,
        bundled,
        database_jobs,
        bundle_jobs,
        jobs,
        ledger.record_bytes,
        ledger.state_bytes,
    )
