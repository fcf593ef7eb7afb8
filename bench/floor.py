"""(a) The floor: the transition store's one-statement commit, straight through asyncpg.

Each worker owns one thread row and runs ``ztate.services.store.transitions.COMMIT``
(compare-and-swap on the head by version and digest, plus the ledger insert, as
one statement) from the version it last committed, with the byte sizes of a real
1 KB transition. The pool is configured as ``TransitionStore`` configures its own
(service role, no reset query on release). Only the digest changes per commit: it
is unique in the ledger and each record's parent.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

import asyncpg

from bench import cpu
from bench.loadgen import Operation, Sample, closed_loop
from bench.workload import INITIAL_STATE, TRUST_DOMAIN, WRITER_NODE
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.record import GENESIS_PARENT, KIND_TRANSITION, build_record, seal
from ztate.services.policy.changes import apply_patch
from ztate.services.runtime.identity import Identity, Role
from ztate.services.store.group_commit import CommitArgs, GroupCommitter, Outcome
from ztate.services.store.interface import Commit
from ztate.services.store.transitions import COMMIT, COMMIT_SLOTS, MAX_BATCH, commit_outcome

INSERT_HEAD = """
INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name, policy_digest)
VALUES ($1, 0, $2, $3, 'bench', $4)
"""


@dataclass(frozen=True)
class CommitPayload:
    """The bytes one commit writes, taken from a real sealed 1 KB transition."""

    state_bytes: bytes
    record_bytes: bytes
    signature: str
    key_id: str
    node_id: str
    policy_digest: str


def commit_payload(patch: dict[str, object], keyring: Keyring, policy_digest: str) -> CommitPayload:
    node_id = Identity(TRUST_DOMAIN, Role.NODE, WRITER_NODE).spiffe_id
    state_bytes = canonical_bytes(apply_patch(INITIAL_STATE, patch))
    sealed = seal(
        build_record(
            kind=KIND_TRANSITION,
            thread_id="t-bench-payload",
            version=1,
            parent_digest=GENESIS_PARENT,
            node_id=node_id,
            patch=patch,
            state_digest=sha256_hex(state_bytes),
            policy_digest=policy_digest,
            receipt_digest=None,
            key_id=keyring.current,
            committed_at=datetime.now(UTC),
        ),
        keyring,
    )
    return CommitPayload(
        state_bytes, sealed.record_bytes, sealed.signature, sealed.key_id, node_id, policy_digest
    )


class HeadWriter:
    """One worker: commits version after version on its own thread."""

    def __init__(
        self,
        pool: asyncpg.Pool | asyncpg.Connection,
        thread_id: str,
        payload: CommitPayload,
        committer: GroupCommitter | None = None,
    ) -> None:
        self._pool = pool
        self._committer = committer  # the store's group commit, or each commit alone
        self._thread_id = thread_id
        self._payload = payload
        self._version = 0

    @property
    def thread_id(self) -> str:
        return self._thread_id

    async def create(self) -> None:
        await self._pool.execute(
            INSERT_HEAD,
            self._thread_id,
            _digest(self._thread_id, 0),
            canonical_bytes(INITIAL_STATE),
            self._payload.policy_digest,
        )

    async def commit(self) -> None:
        args = commit_args(self._payload, self._thread_id, self._version, datetime.now(UTC))
        if self._committer is not None:
            outcome = await self._committer.commit(cast(CommitArgs, args))
        else:
            outcome = commit_outcome(await self._pool.fetchval(COMMIT, *args))
        if outcome.commit is not Commit.COMMITTED:
            raise RuntimeError(f"floor: {outcome.commit.name} on {self._thread_id}, a bench bug")
        self._version += 1


def commit_args(
    payload: CommitPayload, thread_id: str, expected_version: int, now: datetime
) -> tuple[object, ...]:
    """``COMMIT``'s parameters for version ``expected_version + 1`` of ``thread_id``: only
    the digests change from one commit to the next (each unique in the ledger)."""
    version = expected_version + 1
    digest = _digest(thread_id, version)
    return (
        thread_id,
        expected_version,
        version,
        digest,
        payload.state_bytes,
        _digest(thread_id, expected_version),
        payload.node_id,
        payload.key_id,
        payload.signature,
        now,
        payload.record_bytes,
        digest[:32],
        digest[32:],
        [],  # a version that wakes no node, as ztate's 1 KB receipt
        None,  # under no lease
        None,
    )


def _digest(thread_id: str, version: int) -> str:
    return hashlib.sha256(f"{thread_id}/{version}".encode()).hexdigest()


async def keep_session(_conn: asyncpg.Connection) -> None:
    """No reset query on release, as ``TransitionStore`` does."""


async def measure_floor(
    dsn: str,
    payload: CommitPayload,
    *,
    role: str,
    pool_size: int,
    concurrency: int,
    warmup: float,
    duration: float,
    meters: Mapping[str, cpu.CpuMeter],
    grouped: bool = False,
) -> Sample:
    """One closed-loop run of commits, ``concurrency`` workers on fresh threads; through
    the store's group commit (``COMMIT_SLOTS`` statements in flight, the commits that
    arrive meanwhile together in one) when ``grouped``, else each alone."""
    pool = await asyncpg.create_pool(
        dsn,
        min_size=pool_size,
        max_size=pool_size,
        reset=keep_session,
        server_settings={"role": role, "application_name": "ztate-bench-floor"},
    )
    try:
        prefix = f"floor-{uuid.uuid4().hex[:8]}"
        committer = None
        if grouped:

            async def alone(args: CommitArgs) -> Outcome:
                return commit_outcome(await pool.fetchval(COMMIT, *args))

            committer = GroupCommitter(pool, alone, max_in_flight=COMMIT_SLOTS, max_batch=MAX_BATCH)
        writers = [
            HeadWriter(pool, f"{prefix}-{n}", payload, committer) for n in range(concurrency)
        ]
        for writer in writers:
            await writer.create()
        operations: list[Operation] = [writer.commit for writer in writers]
        return await closed_loop(
            "floor: group commit" if grouped else "floor: asyncpg CAS",
            operations,
            warmup=warmup,
            duration=duration,
            meters=meters,
        )
    finally:
        await pool.close()
