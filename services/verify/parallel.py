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
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import queue
import re
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
    ALL_ROWS,
    BUNDLE_ORDER,
    HEADLESS,
    PREFETCH,
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
    checkpoints_from_db,
    connect,
    head_from_db,
    no_such_thread,
    row_from_db,
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
#   (_ROW, LedgerRow)                          a database row of it
#   (_END, Head or None)                       the group ends: the source's head
_START, _LINES, _ROW, _END = 0, 1, 2, 3
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
            elif kind == _ROW:
                assert current is not None
                current.add(item[1])
            elif kind == _START:
                current = run.thread(item[1])
                if item[2] is not None:
                    current.expect_checkpoints(item[2])
            else:
                assert current is not None
                current.check_head(item[1])
                current = None
    results.put(("done", run.summary))


@dataclass
class _Workers:
    """The leader's side: the worker processes, their batches and their results."""

    trust: Trust
    report: Report
    jobs: int
    processes: list[ForkProcess] = field(default_factory=list)
    inboxes: list[Connection] = field(default_factory=list)
    batches: list[list[Item]] = field(default_factory=list)
    summaries: list[Summary] = field(default_factory=list)

    def __post_init__(self) -> None:
        context = multiprocessing.get_context("fork")
        self.results = context.Queue()
        for _ in range(self.jobs):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=_work,
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
        if kind == "finding":
            self.report(value)
        else:
            self.summaries.append(value)
        while not block:
            try:
                kind, value = self.results.get_nowait()
            except queue.Empty:
                return True
            if kind == "finding":
                self.report(value)
            else:
                self.summaries.append(value)
        return True

    def finish(self) -> Summary:
        """Send what is left, wait for every worker, and add up their counts."""
        for worker in range(self.jobs):
            if self.batches[worker]:
                self._flush(worker)
            self.inboxes[worker].send(None)
        while len(self.summaries) < self.jobs:
            if not self._drain(block=True) and any(
                p.exitcode not in (None, 0) for p in self.processes
            ):
                self.stop()
                raise VerifyError("a verification worker stopped unexpectedly")
        for process in self.processes:
            process.join()
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
    """``ztate.services.verify.checks.verify_database`` on ``jobs`` worker processes: the leader
    streams one snapshot and hands out thread groups as rows."""
    leader = Verification(trust, report)
    trust = leader.trust = await _stored_policies(dsn, leader)  # before the workers fork
    workers = _Workers(trust, report, jobs)  # forked while no connection is open
    try:
        conn = await connect(dsn)
        try:
            async with conn.transaction(readonly=True, isolation="repeatable_read"):
                await check_policies_are_the_ledgers(conn, trust, thread_id)
                await _dispatch_database(conn, leader, workers, thread_id)
        except asyncpg.UndefinedTableError:
            raise VerifyError(
                "the database holds no ztate ledger (schema ztate is missing)"
            ) from None
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise VerifyError(f"reading the ledger failed: {type(exc).__name__}: {exc}") from None
        finally:
            await conn.close()
        counted = workers.finish()
    except BaseException:
        workers.stop()
        raise
    summary = leader.summary
    summary.threads += counted.threads
    summary.records += counted.records
    summary.failures += counted.failures
    return summary


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


async def _dispatch_database(
    conn: asyncpg.Connection, leader: Verification, workers: _Workers, thread_id: str | None
) -> None:
    current: str | None = None
    head: Head | None = None
    worker = groups = 0
    query, args = (ALL_ROWS, ()) if thread_id is None else (THREAD_ROWS, (thread_id,))
    async for stored in conn.cursor(query, *args, prefetch=PREFETCH):
        owner = stored["thread_id"]
        if owner != current:
            if current is not None:
                workers.send(worker, (_END, head or await head_from_db(conn, current)))
            current, head, worker, groups = owner, None, workers.assign(), groups + 1
            leader.saw(owner)
            checkpoints = (
                await checkpoints_from_db(conn, owner)
                if leader.trust.checkpoint_keys is not None
                else None
            )
            workers.send(worker, (_START, owner, checkpoints))
        workers.send(worker, (_ROW, row_from_db(stored)))
        if stored["head_version"] is not None:
            head = Head(stored["head_version"], stored["head_digest"], bytes(stored["head_state"]))
    if current is not None:
        workers.send(worker, (_END, head or await head_from_db(conn, current)))
    for orphan in await conn.fetch(HEADLESS, thread_id):
        leader.headless(orphan["thread_id"], Head(orphan["version"], orphan["head_digest"], None))
    if thread_id is not None and groups == 0 and thread_id not in leader.trust.kept_checkpoints:
        raise no_such_thread(thread_id)
    leader.kept_threads_missing(thread_id)  # --checkpoints FILE: threads without records
