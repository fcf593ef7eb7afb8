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
serialised; a worker holds one thread at a time.

For a database nothing passes through the leader: it opens the snapshot, exports
it (``pg_export_snapshot``), cuts the threads into ``N`` ranges of about as many
threads each, and every worker reads its own range on its own connection in that
same snapshot, with its heads and checkpoints. The leader only reads what needs
the whole ledger (headless threads) once the workers are done. Reading and
verifying thus both scale with the workers, where handing every row over a pipe
made the leader the bottleneck (``--jobs 2`` was slower than one process).

A run either hears every worker's count or gives no verdict. Each worker answers
on a pipe of its own, which only it holds open: when it dies (killed, crashed, or
it stopped on an error such as its connection dropping) the leader reads the end
of that pipe, at once and without polling, and stops the run with ``VerifyError``
naming the worker, how it ended and the threads it was given (exit code 2), never
a summary. A worker never blocks on the leader (a thread of its own sends its
findings), so the leader, which may block sending work, cannot deadlock with it.

A worker that is alive but stuck (a loop, a read from a connection whose server is
gone, a lock it waits on for ever) closes no pipe. So each worker reports progress:
a thread of its own looks at its counts every ``PROGRESS_SECONDS`` and says so when
they moved. A worker that reported nothing, and was given nothing, for
``worker_timeout`` seconds (``--worker-timeout``), while the leader waits for it or
for room in its pipe, is stuck: the leader kills every worker and stops the run with
``VerifyError`` naming it, how much it had verified and what it was given.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import itertools
import multiprocessing
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkProcess
from pathlib import Path
from typing import Any

import asyncpg

from ztate.contract.checkpoints import SignedCheckpoint
from ztate.contract.record import shown
from ztate.services.verify.bundle import (
    CheckpointReader,
    LineProblem,
    Manifest,
    Tally,
    check_records_file,
    head_of,
    line_finding,
    record_lines,
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
SHOWN_THREADS = 5  # thread ids a failure names before "and N more"
EXIT_SECONDS = 5.0  # to learn how a worker whose pipe closed ended (it is ending)
WORKER_TIMEOUT = 300.0  # seconds without progress after which a worker is stuck (default)
PROGRESS_SECONDS = 0.25  # how often a worker looks whether its counts moved
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


class _Outbox:
    """A worker's messages to the leader, sent by a thread of the worker's own: the
    worker never blocks on a leader that is busy sending it work. ``close`` sends
    what is left; the worker's end of the pipe then closes, as it does when the
    process dies, which is how the leader knows a worker ended."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send, name="ztate-verify-outbox")
        self._thread.start()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self, summary: Summary) -> None:
        """Report progress whenever ``summary``'s counts moved (looked at every
        ``PROGRESS_SECONDS``): a worker stuck anywhere reports none."""

        def look() -> None:
            last = (0, 0, 0)
            while not self._closing.wait(PROGRESS_SECONDS):
                now = (summary.threads, summary.records, summary.failures)
                if now != last:
                    self.put("progress", now[:2])
                    last = now

        self._watcher = threading.Thread(target=look, name="ztate-verify-progress", daemon=True)
        self._watcher.start()

    def put(self, kind: str, value: Any) -> None:
        self._queue.put((kind, value))

    def _send(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except OSError:  # the leader is gone: nobody waits for this worker's count,
                os._exit(1)  # so it stops now (its queue would grow, its range be read)

    def close(self) -> None:
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join()
        self._queue.put(None)
        self._thread.join()
        self._conn.close()


Body = Callable[[Connection, _Outbox, Trust], None]


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(leader: int) -> None:
    """End this worker (SIGKILL, no output) as soon as the leader dies: a database
    worker reads its range without a word from the leader, and would otherwise read
    it all (or wait on a lock for ever) for nobody. Linux sends the signal when the
    thread that forked the worker ends: the leader forks from the thread that then
    waits for the workers. Elsewhere a worker notices when it next talks to the leader."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != leader:  # it died before the line above: no signal will come
        os._exit(1)


def _worker(
    body: Body,
    inbox: Connection,
    out: Connection,
    trust: Trust,
    inherited: Sequence[Connection],
    leader: int,
) -> None:
    """A worker process: ``body``, then its count, or why it stopped (exit code 1)."""
    _die_with(leader)
    for conn in inherited:  # the leader's ends, copied by fork: only the leader holds them
        conn.close()
    outbox = _Outbox(out)
    try:
        body(inbox, outbox, trust)
    except EOFError:  # the leader went away: nobody waits for a count
        outbox.close()
        raise SystemExit(1) from None
    except VerifyError as error:
        outbox.put("failed", str(error))
        outbox.close()
        raise SystemExit(1) from None
    except BaseException as exc:  # a bug: its type only (its text may hold a value)
        outbox.put("failed", f"{type(exc).__name__} raised")
        outbox.close()
        raise SystemExit(1) from None
    outbox.close()


def _work(inbox: Connection, outbox: _Outbox, trust: Trust) -> None:
    """Verify the thread groups the leader sends, until it sends None."""
    run = Verification(trust, lambda finding: outbox.put("finding", finding))
    outbox.watch(run.summary)
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
    outbox.put("done", run.summary)


# a worker's share of a database: (dsn, snapshot, first thread, end thread, thread)
_Share = tuple[str, str, str | None, str | None, str | None]
_SNAPSHOT = re.compile(r"[0-9A-F]+-[0-9A-F]+(?:-[0-9]+)?")  # what pg_export_snapshot returns
# the first thread id of each of $1 ranges of about as many threads, in thread order
RANGE_STARTS = """
SELECT min(thread_id) AS first
  FROM (SELECT thread_id, ntile($1) OVER (ORDER BY thread_id) AS part FROM ztate.threads) s
 GROUP BY part ORDER BY first
"""


def _work_database(inbox: Connection, outbox: _Outbox, trust: Trust) -> None:
    """Verify this worker's share of the database (or nothing, if sent None)."""
    run = Verification(trust, lambda finding: outbox.put("finding", finding))
    outbox.watch(run.summary)
    share: _Share | None = inbox.recv()
    if share is not None:
        _run_in_a_thread(_verify_share(run, share))
    outbox.put("kept", sorted(run.kept_seen))
    outbox.put("done", run.summary)


def _run_in_a_thread(work: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run(work)`` on a new thread, re-raising what it raised.

    The worker is forked from the leader's running event loop, and its main thread
    still counts as running that loop (Python 3.11 does not reset it at fork), so
    asyncio refuses to run another there; a new thread has no loop. This costs one
    thread per worker, not per record, and uses no private asyncio API."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(work)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="ztate-verify-share")
    thread.start()
    thread.join()
    if raised:
        raise raised[0]


async def _verify_share(run: Verification, share: _Share) -> None:
    dsn, snapshot, first, end, thread_id = share
    if not _SNAPSHOT.fullmatch(snapshot):
        raise VerifyError("the leader's snapshot id is not one Postgres exports")
    conn = await connect(dsn)
    try:
        # no transaction block to leave: a read-only transaction needs no commit, and
        # leaving one on a dropped connection would hide why it dropped; close ends it
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        await conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
        query, args = (
            (THREAD_ROWS, (thread_id,)) if thread_id is not None else (RANGE_ROWS, (first, end))
        )
        await verify_rows(conn, run, query, args)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise VerifyError(f"reading the ledger failed: {type(exc).__name__}: {exc}") from None
    finally:
        await conn.close()


def _signal_name(number: int) -> str:
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:  # a number with no name (a real-time signal)
        return ""


def _share_text(first: str | None, end: str | None, thread_id: str | None) -> str:
    """A database worker's share, as a failure names it."""
    if thread_id is not None:
        return f"thread {shown(thread_id)}"
    if first is None and end is None:
        return "every thread"
    if first is None:
        return f"the threads before {shown(end)}"
    if end is None:
        return f"the threads from {shown(first)} on"
    return f"the threads from {shown(first)} to before {shown(end)}"


@dataclass
class _Worker:
    """The leader's side of one worker: its process, its two pipes, what it was given."""

    process: ForkProcess
    inbox: Connection  # the leader sends work
    answers: Connection  # the worker sends findings, its count, or why it stopped
    threads: list[str] = field(default_factory=list)  # a bundle's thread groups given
    share: str | None = None  # a database worker's range, as a failure names it
    summary: Summary | None = None
    failed: str | None = None  # why it stopped, in its own words
    heard: float = field(default_factory=time.monotonic)  # its last progress, or work given
    done: tuple[int, int] = (0, 0)  # threads and records verified, as it last reported

    def given(self) -> str:
        if self.share is not None:
            return self.share
        if not self.threads:
            return "the threads it was to be given"
        named = ", ".join(shown(t) for t in self.threads[:SHOWN_THREADS])
        more = len(self.threads) - SHOWN_THREADS
        if more > 0:
            named += f" and {more} more"
        count = f"{len(self.threads)} thread" + ("s" if len(self.threads) > 1 else "")
        return f"the {count} given to it ({named})"


@dataclass
class _Workers:
    """The leader's side: the worker processes, their batches and their results."""

    trust: Trust
    report: Report
    jobs: int
    body: Body = _work
    timeout: float = WORKER_TIMEOUT  # seconds without progress: the worker is stuck
    workers: list[_Worker] = field(default_factory=list)
    batches: list[list[Item]] = field(default_factory=list)
    kept_seen: set[str] = field(default_factory=set)
    # the worker the leader is sending to, and since when: a send that waits
    # ``timeout`` for room in a worker's pipe means the worker reads nothing
    _sending: tuple[int, float] | None = field(default=None, init=False)
    _stuck: int | None = field(default=None, init=False)  # found stuck in a send
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        context = multiprocessing.get_context("fork")
        # the objects the leader holds now go to the permanent generation: the
        # workers' collections then never walk (and copy on write) the leader's heap
        gc.freeze()
        try:
            self._fork(context)
        finally:
            gc.unfreeze()
        threading.Thread(
            target=self._watch_sends, name="ztate-verify-watchdog", daemon=True
        ).start()

    def _watch_sends(self) -> None:
        """Kill the workers when a send to one waited ``timeout`` for room: the send
        then fails, and ``post`` names the worker as stuck."""
        while not self._stopping.wait(min(self.timeout / 4, 1.0)):
            sending = self._sending
            if sending is not None and time.monotonic() - sending[1] >= self.timeout:
                self._stuck = sending[0]
                for w in self.workers:
                    if w.process.is_alive():
                        w.process.kill()
                return

    def _fork(self, context: Any) -> None:
        for _ in range(self.jobs):
            receive, send = context.Pipe(duplex=False)
            answers, answer = context.Pipe(duplex=False)
            leaders = [end for w in self.workers for end in (w.inbox, w.answers)]
            process = context.Process(
                target=_worker,
                args=(
                    self.body,
                    receive,
                    answer,
                    self.trust,
                    [*leaders, send, answers],
                    os.getpid(),
                ),
                daemon=True,
            )
            process.start()
            receive.close()
            answer.close()
            self.workers.append(_Worker(process, send, answers))
            self.batches.append([])
        self._next = itertools.cycle(range(self.jobs))

    def assign(self, thread_id: str) -> int:
        """The worker for the next thread group, ``thread_id``'s."""
        worker = next(self._next)
        self.workers[worker].threads.append(thread_id)
        return worker

    def send(self, worker: int, item: Item, *, now: bool = False) -> None:
        """Queue ``item`` for ``worker``; send the queue when it is long, or ``now``."""
        batch = self.batches[worker]
        batch.append(item)
        if now or len(batch) >= BATCH:
            self._flush(worker)

    def _flush(self, worker: int) -> None:
        self.post(worker, self.batches[worker])
        self.batches[worker] = []
        self._drain(block=False)

    def post(self, worker: int, message: Any) -> None:
        """Send ``message`` to ``worker``, or stop the run if it is gone or stuck."""
        self._sending = (worker, time.monotonic())
        try:
            self.workers[worker].inbox.send(message)
        except OSError:  # BrokenPipeError: it died, or the watchdog killed it
            raise self._stopped(worker) from None
        finally:
            self._sending = None
        self.workers[worker].heard = time.monotonic()  # it has work: its clock starts

    def _drain(self, *, block: bool) -> None:
        """Take what the workers sent: everything waiting, or (``block``) at least one
        message or one worker's end. A worker that ended without its count stops the run."""
        waiting = [w.answers for w in self.workers if w.summary is None]
        timeout = 0.0
        if block:
            oldest = min(w.heard for w in self.workers if w.summary is None)
            timeout = max(0.0, oldest + self.timeout - time.monotonic())
        ready_ones = wait(waiting, timeout=timeout)
        if block and not ready_ones:
            stuck = min(
                (i for i, w in enumerate(self.workers) if w.summary is None),
                key=lambda i: self.workers[i].heard,
            )
            if time.monotonic() - self.workers[stuck].heard >= self.timeout:
                raise self._stuck_error(stuck)
        for ready in ready_ones:
            assert isinstance(ready, Connection)
            worker = next(i for i, w in enumerate(self.workers) if w.answers is ready)
            try:
                while True:
                    kind, value = ready.recv()
                    self._take(worker, kind, value)
                    if self.workers[worker].summary is not None or not ready.poll():
                        break
            except (EOFError, OSError):  # its end closed: it ended (perhaps mid-message)
                raise self._stopped(worker) from None

    def _take(self, worker: int, kind: str, value: Any) -> None:
        self.workers[worker].heard = time.monotonic()
        if kind == "progress":
            self.workers[worker].done = value
        elif kind == "finding":
            self.report(value)
        elif kind == "kept":
            self.kept_seen.update(value)
        elif kind == "failed":
            self.workers[worker].failed = value
        else:
            self.workers[worker].summary = value

    def _stopped(self, worker: int) -> VerifyError:
        """The run's end when ``worker`` ended without its count: every worker is stopped,
        and the error names it, how it ended and what it was given."""
        if self._stuck is not None:  # the watchdog killed the workers: one was stuck
            return self._stuck_error(self._stuck)
        w = self.workers[worker]
        try:  # what it said before it ended (a failure's cause)
            while w.failed is None and w.answers.poll():
                kind, value = w.answers.recv()
                self._take(worker, kind, value)
        except (EOFError, OSError):
            pass
        w.process.join(EXIT_SECONDS)
        code = w.process.exitcode
        if w.failed is not None:
            how = f"failed ({w.failed})"
        elif code is not None and code < 0:
            how = f"was killed by signal {-code}{_signal_name(-code)}"
        elif code is not None:
            how = f"exited with code {code}"
        else:
            how = "closed its pipe"
        self.stop()
        return VerifyError(
            f"verification worker {worker + 1} of {self.jobs} {how} before it finished; "
            f"the ledger is NOT verified. Not (all) checked: {w.given()}."
        )

    def _stuck_error(self, worker: int) -> VerifyError:
        """The run's end when ``worker`` made no progress for ``timeout`` seconds:
        every worker is killed, and the error names it, what it had verified and what
        it was given."""
        w = self.workers[worker]
        self.stop()
        threads, records = w.done
        return VerifyError(
            f"verification worker {worker + 1} of {self.jobs} made no progress for "
            f"{self.timeout:g} s (--worker-timeout) and was stopped (records read: "
            f"{records}, threads: {threads}); the ledger is NOT verified. "
            f"Not (all) checked: {w.given()}."
        )

    def finish(self) -> Summary:
        """Send what is left, wait for every worker's count, and add them up."""
        for worker in range(self.jobs):
            if self.batches[worker]:
                self._flush(worker)
            if self.body is _work:  # a database worker stops after its one share
                self.post(worker, None)
        while any(w.summary is None for w in self.workers):
            self._drain(block=True)
        for w in self.workers:
            w.process.join()
        self._stopping.set()
        total = Summary()
        for w in self.workers:
            assert w.summary is not None
            total.threads += w.summary.threads
            total.records += w.summary.records
            total.failures += w.summary.failures
        return total

    def stop(self) -> None:
        self._stopping.set()
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
            w.process.join()


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
    directory: Path,
    trust: Trust,
    report: Report,
    *,
    jobs: int,
    thread_id: str | None = None,
    worker_timeout: float = WORKER_TIMEOUT,
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
    workers = _Workers(trust, report, jobs, timeout=worker_timeout)
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
    read = Tally()
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

    for number, line in record_lines(directory, read):
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
            current, worker = owner, workers.assign(owner)
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
    check_records_file(manifest, read, len(threads), leader.finding)
    return seen


async def verify_database_parallel(
    dsn: str,
    trust: Trust,
    report: Report,
    *,
    jobs: int,
    thread_id: str | None = None,
    worker_timeout: float = WORKER_TIMEOUT,
) -> Summary:
    """``ztate.services.verify.checks.verify_database`` on ``jobs`` worker processes, each
    reading and verifying its own range of threads in the leader's snapshot."""
    leader = Verification(trust, report)
    trust = leader.trust = await _stored_policies(dsn, leader)  # before the workers fork
    # forked while no connection is open
    workers = _Workers(trust, report, jobs, body=_work_database, timeout=worker_timeout)
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
                        workers.workers[worker].share = _share_text(starts[worker], end, thread_id)
                    else:
                        workers.workers[worker].share = "no thread"
                    workers.post(worker, share)
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
