"""``ztate verify --jobs N`` when a worker process does not finish: it is killed, it
raises, its database connection drops, or the bundle file ends while workers run.

The run must never say "verified" of a ledger part of which nobody checked: it stops
with exit code 2 and one line naming the worker, how it ended and the threads it was
given, and it never hangs. The workers are real forked processes and die for real:
by SIGKILL or an exception at a known record (through the approval keys they inherit
from the leader), or because a test terminates one's Postgres backend while the
worker waits on a lock the test holds. Bundle runs are guarded by a watchdog that
fails the test (instead of hanging the suite) if the verifier hangs.
"""

from __future__ import annotations

import asyncio
import base64
import faulthandler
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.harness import fresh_database
from tests.integration.test_watch_limits import eventually
from tests.unit.test_verify_bundle import APPROVAL_KEY, KEYRING, POLICIES, THREAD, honest_chain
from tests.unit.test_verify_bundle import write as write_bundle
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.record import GENESIS_PARENT, KIND_GENESIS, KIND_TRANSITION, build_record, seal
from ztate.services.policy.changes import apply_patch
from ztate.services.store.migrate import migrate
from ztate.services.verify.bundle import BUNDLE_COUNT, BUNDLE_HASH, BUNDLE_LINE, RECORDS
from ztate.services.verify.checks import HEAD, Finding, Trust, VerifyError
from ztate.services.verify.parallel import verify_bundle_parallel

REPO = Path(__file__).resolve().parents[2]
ZTATE = Path(sys.executable).with_name("ztate")
POLICY_FILE = REPO / "services" / "defaults" / "policy.yaml"
WATCHDOG_SECONDS = 60


@pytest.fixture
def watchdog() -> Iterator[None]:
    """A hang fails the run with every thread's traceback, instead of hanging it."""
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class DeadlyKeys(Mapping[str, Ed25519PublicKey]):
    """The approval keys, except that looking one up in a worker process (which the
    worker does at the first record with a receipt) kills it or raises."""

    def __init__(self, how: str) -> None:
        self._keys = {"approval-k1": APPROVAL_KEY.public_key()}
        self._how, self._leader = how, os.getpid()

    def __getitem__(self, key_id: str) -> Ed25519PublicKey:
        if os.getpid() != self._leader:
            if self._how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("a bug in the checks, with a value: secret-ish")
        return self._keys[key_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@pytest.mark.parametrize(
    ("how", "ended"),
    [("killed", "was killed by signal 9 (SIGKILL)"), ("raises", "failed (RuntimeError raised)")],
)
def test_a_worker_that_dies_mid_thread_stops_the_run_naming_its_threads(
    tmp_path: Path, watchdog: None, how: str, ended: str
) -> None:
    # version 2 carries a receipt: the worker verifies versions 0 and 1, then dies
    folder = write_bundle(tmp_path / "bundle", honest_chain().rows)
    trust = Trust(KEYRING, DeadlyKeys(how), POLICIES)
    findings: list[Finding] = []

    with pytest.raises(VerifyError) as stopped:
        verify_bundle_parallel(folder, trust, findings.append, jobs=2)

    assert str(stopped.value) == (
        f"verification worker 1 of 2 {ended} before it finished; the ledger is NOT "
        f"verified. Not (all) checked: the 1 thread given to it ({THREAD})."
    )
    assert "secret-ish" not in str(stopped.value)  # an exception's text may hold a value
    assert findings == []


def test_a_bundle_file_that_ends_while_workers_run_is_never_verified(
    tmp_path: Path, watchdog: None
) -> None:
    """records.jsonl is a pipe the test writes: it ends in the middle of line 3, while
    the workers wait for more. The manifest describes the whole file."""
    folder = write_bundle(tmp_path / "bundle", honest_chain().rows)
    whole = (folder / RECORDS).read_bytes()
    lines = whole.splitlines(keepends=True)
    cut = len(lines[0]) + len(lines[1]) + len(lines[2]) // 2
    (folder / RECORDS).unlink()
    os.mkfifo(folder / RECORDS)

    def write_part() -> None:
        with (folder / RECORDS).open("wb") as fifo:  # blocks until the verifier opens it
            fifo.write(whole[:cut])

    writer = threading.Thread(target=write_part)
    writer.start()
    findings: list[Finding] = []
    try:
        summary = verify_bundle_parallel(folder, trust_of_bundle(), findings.append, jobs=2)
    finally:
        writer.join()

    assert summary.exit_code == 1
    assert summary.records == 2  # versions 0 and 1; line 3 is no row
    # the workers' findings and the leader's interleave in no fixed order
    assert sorted((f.check, f.thread_id or "", f.version or 0) for f in findings) == [
        (BUNDLE_COUNT, "", 0),
        (BUNDLE_HASH, "", 0),
        (BUNDLE_LINE, "", 0),  # line 3: the part of it that arrived is no row
        (HEAD, THREAD, 3),  # the manifest's head is version 3, the last record read is 1
    ]


def trust_of_bundle() -> Trust:
    return Trust(KEYRING, {"approval-k1": APPROVAL_KEY.public_key()}, POLICIES)


# --- a database worker whose connection drops --------------------------------------------

NODE = "spiffe://ztate.test/node/planner"
OPERATOR = "spiffe://ztate.test/operator/admin"
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
TRANSITION_COLUMNS = (
    "thread_id",
    "version",
    "digest",
    "parent_digest",
    "node_id",
    "key_id",
    "signature",
    "record",
    "state",
    "committed_at",
)
THREAD_COLUMNS = ("thread_id", "version", "head_digest", "state", "policy_name", "policy_digest")


def sealed_thread(thread_id: str, versions: int) -> list[tuple[Any, ...]]:
    """A clean thread's transition rows (COPY tuples), sealed under the test keyring."""
    policy = POLICIES.policies["pipeline"]
    rows: list[tuple[Any, ...]] = []
    state: dict[str, Any] = {}
    parent = GENESIS_PARENT
    for version in range(versions):
        patch: dict[str, Any] = (
            {"raw_text": "refund", "authority": {"tenant": "acme"}}
            if version == 0
            else {"pending_transition": {"action": "refund", "order_id": f"A-{version}"}}
        )
        state = apply_patch(state, patch)
        state_bytes = canonical_bytes(state)
        committed_at = T0 + timedelta(minutes=version)
        sealed = seal(
            build_record(
                kind=KIND_GENESIS if version == 0 else KIND_TRANSITION,
                thread_id=thread_id,
                version=version,
                parent_digest=parent,
                node_id=OPERATOR if version == 0 else NODE,
                patch=patch,
                state_digest=sha256_hex(state_bytes),
                policy_digest=policy.digest,
                receipt_digest=None,
                key_id="k1",
                committed_at=committed_at,
            ),
            KEYRING,
        )
        rows.append(
            (
                thread_id,
                version,
                sealed.digest,
                parent,
                sealed.record["node_id"],
                "k1",
                sealed.signature,
                sealed.record_bytes,
                state_bytes,
                committed_at,
            )
        )
        parent = sealed.digest
    return rows


async def a_ledger(server_dsn: str, threads: list[str]) -> str:
    dsn = await fresh_database(server_dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn, "ztate_transition")
        policy = POLICIES.policies["pipeline"]
        for thread_id in threads:
            rows = sealed_thread(thread_id, 3)
            last = rows[-1]
            await conn.copy_records_to_table(
                "threads",
                schema_name="ztate",
                records=[(thread_id, last[1], last[2], last[8], policy.name, policy.digest)],
                columns=THREAD_COLUMNS,
            )
            await conn.copy_records_to_table(
                "transitions", schema_name="ztate", records=rows, columns=TRANSITION_COLUMNS
            )
    finally:
        await conn.close()
    return dsn


async def test_a_worker_whose_connection_drops_stops_the_run_naming_its_range(
    postgres_server_dsn: str, tmp_path: Path
) -> None:
    dsn = await a_ledger(postgres_server_dsn, ["drop-a", "drop-b"])
    keyring = tmp_path / "hmac-keyring.json"
    keyring.write_text(
        json.dumps({"current": "k1", "keys": {"k1": base64.b64encode(bytes(range(32))).decode()}})
    )
    approval = tmp_path / "approval-public.json"
    raw = APPROVAL_KEY.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    approval.write_text(json.dumps({"approval-k1": base64.b64encode(raw).decode()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(
        DATABASE_URL=dsn,
        ZTATE_HOME=str(tmp_path / "home"),
        ZTATE_HMAC_KEYRING_FILE=str(keyring),
        ZTATE_APPROVAL_PUBLIC_KEYS_FILE=str(approval),
        ZTATE_POLICY_PATH=str(POLICY_FILE),
    )
    # the workers' first read waits behind this lock: each is then inside its share
    locker = await asyncpg.connect(dsn)
    watcher = await asyncpg.connect(dsn)
    lock = locker.transaction()
    await lock.start()
    await locker.execute("LOCK TABLE ztate.transitions IN ACCESS EXCLUSIVE MODE")
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        *("verify", "--jobs", "2", "--json"),
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        waiting: list[int] = []

        async def both_workers_wait() -> bool:
            waiting[:] = [
                row["pid"]
                for row in await watcher.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' ORDER BY pid"
                )
            ]
            return len(waiting) == 2

        await eventually(both_workers_wait)
        assert await watcher.fetchval("SELECT pg_terminate_backend($1)", waiting[0])
        await lock.rollback()  # the other worker goes on and finishes its share
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await locker.close()
        await watcher.close()

    assert process.returncode == 2
    assert out == b""  # no finding and, above all, no summary
    message = err.decode()
    shares = {"1": "the threads before drop-b", "2": "the threads from drop-b on"}
    match = re.fullmatch(
        r"ztate verify: cannot verify: verification worker (1|2) of 2 failed \(reading the "
        r"ledger failed: (\w+): (.*)\) before it finished; the ledger is NOT verified\. "
        r"Not \(all\) checked: (.*)\.\n",
        message,
    )
    assert match is not None, message
    assert match[4] == shares[match[1]]
    assert match[2] in {"AdminShutdownError", "ConnectionDoesNotExistError"}, message
