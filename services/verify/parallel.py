"""Verification on several processes: ``ztate verify --jobs N``.

Threads are independent chains, so their verification parallelises by thread.
One leader reads the source once, in order, and does what needs the whole
source: the bundle file's hash and counts, the order of thread groups, the
merge with the checkpoints, headless threads. It hands each thread's group of
rows, whole and in order, to one of ``N`` worker processes, which run exactly
the checks of ``ztate.services.verify.checks`` (``ThreadVerifier``) on it. Findings are the
same as a single process finds; only the order in which threads' findings are
printed may differ.

For a bundle the leader does not parse a line: the thread id and version sit
at the start of every line the exporter writes, and a line that does not start
so is parsed by the leader (and reported there if it is no row). Workers are
forked, so they inherit the trust (keys and policies) without it ever being
serialised; memory stays constant per worker (one thread's previous record).

For a database nothing passes through the leader: it opens the snapshot, exports
it (``pg_export_snapshot``), cuts the threads into ``N`` ranges of about as many
threads each, and every worker reads its own range on its own connection in that
same snapshot, with its heads and checkpoints. The leader only reads what needs
the whole ledger (headless threads) once the workers are done. Reading and
verifying thus both scale with the workers, where handing every row over a pipe
made the leader the bottleneck (``--jobs 2`` was slower than one process).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import itertools
import multiprocessing
import os
import queue
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkProcess
from pathlib import Path
from typing import Any

import asyncpg

from ztate.contract.checkpoints import SignedCheckpoint
from ztate.services.verify.bundle import (
    CheckpointReader,
    LineProblem,
    Manifest,
    check_records_file,
    head_of,
    line_finding,
    open_records,
    row_from_line,
    usable_manifest,
)
from ztate.services.verify.checks import (
    BUNDLE_ORDER,
    HEADLESS,
    RANGE_ROWS,
    THREAD_ROWS,
    Finding,
    Head,
    Report,
    Summary,
    ThreadVerifier,
    Trust,
    Verification,
    VerifyError,
    check_policies_are_the_ledgers,
    connect,
    no_such_thread,
    verify_rows,
    with_stored_policies,
)

BATCH = 256  # items per message to a worker
# bundle lines travel as one bytes object per run of consecutive lines of a thread:
# pickling one large bytes is a copy, pickling a tuple per line is not
LINES_BYTES = 256 * 1024
RESULT_POLL_SECONDS = 0.5
# what the exporter writes first on every line (ids are [A-Za-z0-9._:-], 1-128)
_LINE_START = re.compile(rb'\{"thread_id":"([A-Za-z0-9._:-]{1,128})","version":(-?[0-9]{1,19}),')

# messages to a worker: lists of these items
#   (_START, thread_id, checkpoints or None)   a thread's group begins
#   (_LINES, first line number, bytes)         consecutive bundle lines of it
#   (_END, Head or None)                       the group ends: the source's head
_START, _LINES, _END = 0, 1, 3
Item = tuple[Any, ...]


def jobs_wanted(jobs: int) -> int:
    """``--jobs`` as given: 0 means one per core."""
    return (os.cpu_count() or 1) if jobs == 0 else jobs


def _work(inbox: Connection, results: Any, trust: Trust) -> None:
    """A worker: verify the thread groups the leader sends, until it sends None."""
    run = Verification(trust, lambda finding: results.put(("finding", finding)))
    current: ThreadVerifier | None = None
    while (batch := inbox.recv()) is not None:
        for item in batch:
            kind = item[0]
            if kind == _LINES:
                assert current is not None
                lines = item[2].split(b"\n")
                if lines[-1] == b"":
                    lines.pop()  # after the last line's newline
                for number, line in enumerate(lines, item[1]):
                    try:
                        row = row_from_line(line)
                    except LineProblem as problem:
                        run.finding(line_finding(number, problem))
                        continue
                    current.add(row)
            elif kind == _START:
                current = run.thread(item[1])
                if item[2] is not None:
                    current.expect_checkpoints(item[2])
            else:
                assert current is not None
                current.check_head(item[1])
                current = None
    results.put(("done", run.summary))


# a worker's share of a database: (dsn, snapshot, first thread, end thread, thread)
_Share = tuple[str, str, str | None, str | None, str | None]
_SNAPSHOT = re.compile(r"[0-9A-F]+-[0-9A-F]+(?:-[0-9]+)?")  # what pg_export_snapshot returns
# the first thread id of each of $1 ranges of about as many threads, in thread order
RANGE_STARTS = """
SELECT min(thread_id) AS first
  FROM (SELECT thread_id, ntile($1) OVER (ORDER BY thread_id) AS part FROM ztate.threads) s
 GROUP BY part ORDER BY first
"""


def _work_database(inbox: Connection, results: Any, trust: Trust) -> None:
    """A worker: verify its share of the database (or nothing, if sent None)."""
    run = Verification(trust, lambda finding: results.put(("finding", finding)))
    share: _Share | None = inbox.recv()
    if share is not None:
        # forked from a running event loop: this process has none of its own yet
        asyncio.events._set_running_loop(None)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_verify_share(run, share))
        except VerifyError as error:
            results.put(("error", str(error)))
        finally:
            loop.close()
    results.put(("kept", sorted(run.kept_seen)))
    results.put(("done", run.summary))


async def _verify_share(run: Verification, share: _Share) -> None:
    dsn, snapshot, first, end, thread_id = share
    if not _SNAPSHOT.fullmatch(snapshot):
        raise VerifyError("the leader's snapshot id is not one Postgres exports")
    conn = await connect(dsn)
    try:
        async with conn.transaction(readonly=True, isolation="repeatable_read"):
            await conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
            query, args = (
                (THREAD_ROWS, (thread_id,)) if thread_id is not None else (RANGE_ROWS, (first, end))
            )
            await verify_rows(conn, run, query, args)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise VerifyError(f"reading the ledger failed: {type(exc).__name__}: {exc}") from None
    finally:
        await conn.close()


@dataclass
class _Workers:
    """The leader's side: the worker processes, their batches and their results."""

    trust: Trust
    report: Report
    jobs: int
    target: Callable[[Connection, Any, Trust], None] = _work
    processes: list[ForkProcess] = field(default_factory=list)
    inboxes: list[Connection] = field(default_factory=list)
    batches: list[list[Item]] = field(default_factory=list)
    summaries: list[Summary] = field(default_factory=list)
    kept_seen: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        context = multiprocessing.get_context("fork")
        self.results = context.Queue()
        # the objects the leader holds now go to the permanent generation: the
        # workers' collections then never walk (and copy on write) the leader's heap
        gc.freeze()
        try:
            self._fork(context)
        finally:
            gc.unfreeze()

    def _fork(self, context: Any) -> None:
        for _ in range(self.jobs):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=self.target,
                args=(receive, self.results, self.trust),
                daemon=True,
            )
            process.start()
            receive.close()
            self.processes.append(process)
            self.inboxes.append(send)
            self.batches.append([])
        self._next = itertools.cycle(range(self.jobs))

    def assign(self) -> int:
        """The worker for the next thread group."""
        return next(self._next)

    def send(self, worker: int, item: Item, *, now: bool = False) -> None:
        """Queue ``item`` for ``worker``; send the queue when it is long, or ``now``."""
        batch = self.batches[worker]
        batch.append(item)
        if now or len(batch) >= BATCH:
            self._flush(worker)

    def _flush(self, worker: int) -> None:
        try:
            self.inboxes[worker].send(self.batches[worker])
        except (BrokenPipeError, OSError):
            self.stop()
            raise VerifyError("a verification worker stopped unexpectedly") from None
        self.batches[worker] = []
        self._drain(block=False)

    def _drain(self, *, block: bool) -> bool:
        """Pass findings on; True when a result arrived."""
        try:
            kind, value = self.results.get(block=block, timeout=RESULT_POLL_SECONDS)
        except queue.Empty:
            return False
        self._take(kind, value)
        while not block:
            try:
                kind, value = self.results.get_nowait()
            except queue.Empty:
                return True
            self._take(kind, value)
        return True

    def _take(self, kind: str, value: Any) -> None:
        if kind == "finding":
            self.report(value)
        elif kind == "kept":
            self.kept_seen.update(value)
        elif kind == "error":
            self.errors.append(value)
        else:
            self.summaries.append(value)

    def finish(self) -> Summary:
        """Send what is left, wait for every worker, and add up their counts."""
        for worker in range(self.jobs):
            if self.batches[worker]:
                self._flush(worker)
            if self.target is _work:  # a database worker stops after its one share
                self.inboxes[worker].send(None)
        while len(self.summaries) < self.jobs:
            if not self._drain(block=True) and any(
                p.exitcode not in (None, 0) for p in self.processes
            ):
                self.stop()
                raise VerifyError("a verification worker stopped unexpectedly")
        for process in self.processes:
            process.join()
        if self.errors:
            raise VerifyError(self.errors[0])
        total = Summary()
        for summary in self.summaries:
            total.threads += summary.threads
            total.records += summary.records
            total.failures += summary.failures
        return total

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()


def _start_of(line: bytes, number: int, report: Report) -> tuple[str, int] | None:
    """A line's thread id and version, without parsing it when it starts as the
    exporter writes; None (reported) when it is no row at all."""
    match = _LINE_START.match(line)
    if match is not None:
        return match[1].decode("ascii"), int(match[2])
    try:
        row = row_from_line(line)
    except LineProblem as problem:
        report(line_finding(number, problem))
        return None
    return row.thread_id, row.version


def verify_bundle_parallel(
    directory: Path, trust: Trust, report: Report, *, jobs: int, thread_id: str | None = None
) -> Summary:
    """``ztate.services.verify.bundle.verify_bundle`` on ``jobs`` worker processes."""
    leader = Verification(trust, report)  # the leader's own findings and headless threads
    manifest = usable_manifest(directory, leader)
    trust = leader.trust  # with the bundle's policy versions, before the workers fork
    checkpoints = (
        CheckpointReader(directory, manifest, leader.finding, thread_id=thread_id)
        if trust.checkpoint_keys is not None and manifest.checkpoints is not None
        else None
    )
    workers = _Workers(trust, report, jobs)
    try:
        seen = _dispatch(directory, manifest, leader, workers, checkpoints, thread_id)
        counted = workers.finish()
    except BaseException:
        workers.stop()
        raise
    if checkpoints is not None:
        checkpoints.finish()
    if (
        thread_id is not None
        and thread_id not in seen
        and thread_id not in manifest.heads
        and thread_id not in trust.kept_checkpoints
    ):
        raise no_such_thread(thread_id)
    wanted = set(manifest.heads) if thread_id is None else {thread_id}
    for missing in sorted(wanted - seen):
        leader.headless(missing, head_of(manifest, missing))
    for verified in seen:
        leader.saw(verified)
    leader.kept_threads_missing(thread_id)  # --checkpoints FILE: threads without records
    summary = leader.summary
    summary.threads += counted.threads
    summary.records += counted.records
    summary.failures += counted.failures
    return summary


def _dispatch(
    directory: Path,
    manifest: Manifest,
    leader: Verification,
    workers: _Workers,
    checkpoints: CheckpointReader | None,
    thread_id: str | None,
) -> set[str]:
    """Read ``records.jsonl`` once and hand out its thread groups; the threads seen."""
    hasher, lines = hashlib.sha256(), 0
    threads: set[str] = set()
    seen: set[str] = set()
    current: str | None = None
    worker = 0
    run: list[bytes] = []  # consecutive lines of the current thread, not yet sent
    run_first = run_bytes = 0

    def send_run() -> None:
        nonlocal run, run_bytes
        if run:
            workers.send(worker, (_LINES, run_first, b"".join(run)), now=True)
            run, run_bytes = [], 0

    with open_records(directory) as handle:
        for number, line in enumerate(handle, 1):
            hasher.update(line)
            lines += 1
            start = _start_of(line, number, leader.finding)
            if start is None:
                send_run()  # line numbers in a run are consecutive
                continue
            owner, version = start
            threads.add(owner)
            if thread_id is not None and owner != thread_id:
                send_run()
                continue
            if owner != current:
                send_run()
                if current is not None:
                    workers.send(worker, (_END, head_of(manifest, current)))
                if owner in seen:
                    leader.finding(
                        Finding(
                            owner,
                            version,
                            BUNDLE_ORDER,
                            "each thread's lines together, in version order",
                            "the thread's lines resume after another thread's",
                        )
                    )
                seen.add(owner)
                current, worker = owner, workers.assign()
                taken: dict[int, SignedCheckpoint] | None = (
                    checkpoints.take(owner) if checkpoints is not None else None
                )
                workers.send(worker, (_START, owner, taken))
            if not run:
                run_first = number
            run.append(line)
            run_bytes += len(line)
            if run_bytes >= LINES_BYTES:
                send_run()
    send_run()
    if current is not None:
        workers.send(worker, (_END, head_of(manifest, current)))
    check_records_file(manifest, hasher.hexdigest(), lines, len(threads), leader.finding)
    return seen


async def verify_database_parallel(
    dsn: str, trust: Trust, report: Report, *, jobs: int, thread_id: str | None = None
) -> Summary:
    """``ztate.services.verify.checks.verify_database`` on ``jobs`` worker processes, each
    reading and verifying its own range of threads in the leader's snapshot."""
    leader = Verification(trust, report)
    trust = leader.trust = await _stored_policies(dsn, leader)  # before the workers fork
    # forked while no connection is open
    workers = _Workers(trust, report, jobs, target=_work_database)
    try:
        conn = await connect(dsn)
        try:
            async with conn.transaction(readonly=True, isolation="repeatable_read"):
                await check_policies_are_the_ledgers(conn, trust, thread_id)
                snapshot: str = await conn.fetchval("SELECT pg_export_snapshot()")
                starts: list[str | None] = [None]
                if thread_id is None:
                    firsts = [row["first"] for row in await conn.fetch(RANGE_STARTS, jobs)]
                    starts += firsts[1:]
                for worker in range(jobs):
                    share: _Share | None = None
                    if worker < len(starts):
                        end = starts[worker + 1] if worker + 1 < len(starts) else None
                        share = (dsn, snapshot, starts[worker], end, thread_id)
                    _send_share(workers, worker, share)
                # the workers read in the exported snapshot, which lives as long as
                # this transaction: it ends when they are done
                counted = workers.finish()
                orphans = await conn.fetch(HEADLESS, thread_id)
        except asyncpg.UndefinedTableError:
            raise VerifyError(
                "the database holds no ztate ledger (schema ztate is missing)"
            ) from None
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise VerifyError(f"reading the ledger failed: {type(exc).__name__}: {exc}") from None
        finally:
            await conn.close()
    except BaseException:
        workers.stop()
        raise
    for kept in workers.kept_seen:
        leader.saw(kept)
    for orphan in orphans:
        leader.headless(orphan["thread_id"], Head(orphan["version"], orphan["head_digest"], None))
    if (
        thread_id is not None
        and counted.threads == 0
        and thread_id not in leader.trust.kept_checkpoints
    ):
        raise no_such_thread(thread_id)
    leader.kept_threads_missing(thread_id)  # --checkpoints FILE: threads without records
    summary = leader.summary
    summary.threads += counted.threads
    summary.records += counted.records
    summary.failures += counted.failures
    return summary


def _send_share(workers: _Workers, worker: int, share: _Share | None) -> None:
    try:
        workers.inboxes[worker].send(share)
    except (BrokenPipeError, OSError):
        workers.stop()
        raise VerifyError("a verification worker stopped unexpectedly") from None


async def _stored_policies(dsn: str, leader: Verification) -> Trust:
    """The leader's trust with the policy versions the database keeps, read on a
    connection closed again before any worker forks. A version stored after this
    read (a restart with an edited policy during verification) is unknown to the
    run: the records naming it are reported, and a second run verifies them."""
    conn = await connect(dsn)
    try:
        return await with_stored_policies(conn, leader.trust, leader.finding)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise VerifyError(f"reading the ledger failed: {type(exc).__name__}: {exc}") from None
    finally:
        await conn.close()
