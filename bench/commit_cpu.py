"""Postgres CPU per committed ledger row, by batch size: ``python -m bench.commit_cpu``.

What a row costs Postgres inside the commit statements the service sends
(``COMMIT``, ``ztate.commit_transition``, for one row; ``GROUP_COMMIT``,
``ztate.commit_batch``, for a batch), without gRPC, the pipeline or other clients:
one connection, the bench's 1 KB transition (``bench.floor.commit_payload``), each
row on a thread of its own, the backend's CPU read from ``/proc``. It is how the
seventh round of issue 19 (docs/performance.md) measured migrations 0026 and 0027.

``--before FILE`` makes it a paired comparison: two fresh migrated databases, the
first with FILE's SQL run in it by the owner (the definitions a change replaced, to
put them back), the second as migrated, measured in alternating blocks of
statements so that the machine's drift (frequency, other load) falls on both
alike. Without it, the one database as migrated. Not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from bench import cpu
from bench.environment import bench_database, make_keyring, postgres_server, temporary_folder
from bench.floor import INSERT_HEAD, CommitPayload, _digest, commit_args, commit_payload
from bench.workload import DEFAULT_POLICY, INITIAL_STATE, receipt_patch
from ztate.contract.canonical import canonical_bytes
from ztate.contract.keyring import Keyring
from ztate.services.policy.model import Policy
from ztate.services.store.group_commit import GROUP_COMMIT
from ztate.services.store.transitions import COMMIT

DB_ROLE = "ztate_transition"
WARM_UP_STATEMENTS = 30  # past the five runs after which Postgres keeps a generic plan


@dataclass
class Side:
    """One database, one connection, its threads and what its backend has spent."""

    conn: asyncpg.Connection
    backend: cpu.CpuMeter
    threads: list[str]
    payload: CommitPayload
    version: int = 0
    seconds: float = 0.0
    rows: int = 0

    async def block(self, statements: int, *, counted: bool = True) -> None:
        start = self.backend()
        for _ in range(statements):
            now = datetime.now(UTC)
            rows = [commit_args(self.payload, t, self.version, now) for t in self.threads]
            if len(rows) == 1:
                if await self.conn.fetchval(COMMIT, *rows[0]) is None:
                    raise RuntimeError("commit_cpu: a commit was refused, a bench bug")
            else:
                columns = list(zip(*(row[:13] for row in rows), strict=True))
                answers = await self.conn.fetch(GROUP_COMMIT, *columns, [], [])
                if not all(answer["committed"] for answer in answers):
                    raise RuntimeError("commit_cpu: a batch row was refused, a bench bug")
            self.version += 1
        if counted:
            self.seconds += self.backend() - start
            self.rows += statements * len(self.threads)

    @property
    def per_row(self) -> float:
        return 1e6 * self.seconds / self.rows


async def open_side(dsn: str, payload: CommitPayload, batch: int, before: str | None) -> Side:
    conn = await asyncpg.connect(dsn)
    if before:
        await conn.execute(before)
    await conn.execute(f"SET ROLE {DB_ROLE}")
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    threads = [f"t-{uuid.uuid4().hex[:8]}-{n}" for n in range(batch)]
    for thread_id in threads:
        await conn.execute(
            INSERT_HEAD,
            thread_id,
            _digest(thread_id, 0),
            canonical_bytes(INITIAL_STATE),
            payload.policy_digest,
        )
    side = Side(conn, cpu.process(pid), threads, payload)
    await side.block(WARM_UP_STATEMENTS, counted=False)
    return side


async def measure(batches: list[int], rows: int, rounds: int, before: str | None) -> None:
    with temporary_folder() as root:
        keyring = Keyring.load(make_keyring(root), None)
        payload = commit_payload(receipt_patch(1024), keyring, Policy.load(DEFAULT_POLICY).digest)
        with postgres_server(root) as (server_dsn, postmaster):
            for batch in batches:
                statements = max(1, rows // (batch * rounds))
                async with bench_database(server_dsn, postmaster, DB_ROLE) as after_db:
                    if before is None:
                        side = await open_side(after_db.dsn, payload, batch, None)
                        for _ in range(rounds):
                            await side.block(statements)
                        await side.conn.close()
                        print(f"batch {batch:3d}: {side.per_row:5.0f} µs a row ({side.rows} rows)")
                        continue
                    async with bench_database(server_dsn, postmaster, DB_ROLE) as before_db:
                        old = await open_side(before_db.dsn, payload, batch, before)
                        new = await open_side(after_db.dsn, payload, batch, None)
                        for n in range(rounds):  # alternate which goes first
                            first, second = (old, new) if n % 2 == 0 else (new, old)
                            await first.block(statements)
                            await second.block(statements)
                        await old.conn.close()
                        await new.conn.close()
                print(
                    f"batch {batch:3d}: before {old.per_row:5.0f} µs a row, after "
                    f"{new.per_row:5.0f} ({new.per_row - old.per_row:+.0f}; {new.rows} rows each)"
                )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.commit_cpu", description=__doc__)
    parser.add_argument("--batches", default="1,3,8", help="batch sizes (default 1,3,8)")
    parser.add_argument("--rows", type=int, default=6000, help="rows measured a batch size")
    parser.add_argument("--rounds", type=int, default=40, help="alternating blocks")
    parser.add_argument("--before", type=Path, help="SQL that puts back the old definitions")
    args = parser.parse_args()
    before = args.before.read_text(encoding="utf-8") if args.before else None
    batches = [int(b) for b in args.batches.split(",")]
    asyncio.run(measure(batches, args.rows, args.rounds, before))


if __name__ == "__main__":
    main()
