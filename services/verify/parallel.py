"""Verification on several processes: ``ztate verify --jobs N``.

Threads are independent chains, so their verification parallelises by thread.
One leader reads the source once, in order, and does what needs the whole
source: the bundle file's hash and counts, the order of thread groups, the
merge with the checkpoints, headless threads. It hands each thread's group of
rows, whole and in order, to one of ``N`` worker processes, which run exactly
the checks of ``ztate.services.verify.checks`` (``ThreadVerifier``) on it. Findings are the
same as a single process finds; only the order in which threads' findings are
printed may differ.

For a bundle nothing passes through the leader either. It opens the files before
the workers fork (they read them through the same descriptors, with ``os.pread``),
cuts ``records.jsonl`` into ``N`` byte ranges at thread boundaries (between two rows
of different threads, the second's id the greater), and each worker reads and
verifies its own range, and takes its threads' checkpoints from ``checkpoints.jsonl``
itself. The leader reads the records once, in large blocks, for what needs all of
them: the file's hash and line count, and each range's hash and first line number,
which it hands the range's worker as its read reaches the range; and the
checkpoints once, for their hash, count and order. A worker reports the SHA-256 of
the bytes it read and the rows at its range's ends: a file that changed while it
was verified (other bytes, or a cut no longer between two threads) is no verdict.
The leader then checks the order of the thread groups across ranges. Findings are
those of one process whenever the files' threads are in order (as the exporter
writes them); a file out of order is a ``bundle.order`` finding either way. A
bundle file that is not a regular file (a pipe) cannot be cut: one process reads
it. Workers are forked, so they inherit the trust (keys and policies) without it
ever being serialised.

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
a summary. The leader sends a worker nothing but its share, and takes the workers'
messages whenever it is not reading the files itself; a worker (a thread of its own
sends its findings) waits for the leader only when ``OUTBOX`` messages wait already.
Neither can wait for the other for ever.

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
import contextlib
import ctypes
import functools
import gc
import hashlib
import io
import itertools
import multiprocessing
import os
import queue
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkProcess
from pathlib import Path
from typing import Any, BinaryIO

import asyncpg

from ztate.contract.record import shown
from ztate.services.verify import bundle
from ztate.services.verify.bundle import (
    BLOCK,
    CHECKPOINTS,
    RECORDS,
    Checkpoint,
    CheckpointReader,
    LineProblem,
    LineReader,
    Manifest,
    Tally,
    ThreadOrder,
    check_records_file,
    checkpoint_entries,
    checkpoint_from_line,
    checks_checkpoints,
    finish_bundle,
    read_failed,
    row_from_line,
    usable_manifest,
    verify_bundle,
    verify_lines,
)
from ztate.services.verify.checks import (
    HEADLESS,
    NULL_THREAD_ROWS,
    RANGE_ROWS,
    THREAD_ROWS,
    Head,
    Report,
    Summary,
    Trust,
    Verification,
    VerifyError,
    check_policies_are_the_ledgers,
    connect,
    no_such_thread,
    verify_rows,
    with_stored_policies,
)

BATCH = 256  # checkpoints the leader reads between two looks at the workers' findings
SHOWN_THREADS = 5  # thread ids a failure names before "and N more"
EXIT_SECONDS = 5.0  # to learn how a worker whose pipe closed ended (it is ending)
WORKER_TIMEOUT = 300.0  # seconds without progress after which a worker is stuck (default)
PROGRESS_SECONDS = 0.25  # how often a worker looks whether its counts moved
OUTBOX = 4096  # a worker's messages waiting for the leader, at most
# what the exporter writes first on every line (ids are [A-Za-z0-9._:-], 1-128): a cut
# between ranges is looked for only where two such lines name different threads
_LINE_START = re.compile(rb'\{"thread_id":"([A-Za-z0-9._:-]{1,128})",')


def jobs_wanted(jobs: int) -> int:
    """``--jobs`` as given: 0 means one per core."""
    return (os.cpu_count() or 1) if jobs == 0 else jobs


class _Outbox:
    """A worker's messages to the leader, sent by a thread of the worker's own: the
    worker goes on while the leader is busy (it takes the workers' messages between
    the blocks it reads), and waits only when ``OUTBOX`` messages wait already, so that
    a flood of findings is held in no worker's memory. ``close`` sends what is left;
    the worker's end of the pipe then closes, as it does when the process dies, which
    is how the leader knows a worker ended."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=OUTBOX)
        self._thread = threading.Thread(target=self._send, name="ztate-verify-outbox")
        self._thread.start()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.scanned = 0

    def watch(self, summary: Summary) -> None:
        """Report progress whenever ``summary``'s counts moved, or ``scanned`` (lines
        read that are no record: a bundle's checkpoints) did (looked at every
        ``PROGRESS_SECONDS``): a worker stuck anywhere reports none."""

        def look() -> None:
            last = (0, 0, 0, 0)
            while not self._closing.wait(PROGRESS_SECONDS):
                now = (summary.threads, summary.records, summary.failures, self.scanned)
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


# a worker's share of a database: (dsn, snapshot, first thread, end thread, thread)
_Share = tuple[str, str, str | None, str | None, str | None]
_SNAPSHOT = re.compile(r"[0-9A-F]+-[0-9A-F]+(?:-[0-9]+)?")  # what pg_export_snapshot returns
# the first thread id of each of $1 ranges of about as many threads, in thread order
RANGE_STARTS = """
SELECT min(thread_id) AS first
  FROM (SELECT thread_id, ntile($1) OVER (ORDER BY thread_id) AS part FROM ztate.threads
         WHERE thread_id IS NOT NULL) s
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
        if thread_id is None and first is not None and end is None:
            # the last of several ranges: then the rows of no thread, which none holds
            await verify_rows(conn, run, NULL_THREAD_ROWS, ())
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
    share: str | None = None  # its range of threads, as a failure names it
    part: _BundlePart | None = None  # what it read of a bundle
    summary: Summary | None = None
    failed: str | None = None  # why it stopped, in its own words
    heard: float = field(default_factory=time.monotonic)  # its last progress, or work given
    done: tuple[int, int] = (0, 0)  # threads and records verified, as it last reported

    def given(self) -> str:
        return self.share if self.share is not None else "the threads it was to be given"


@dataclass
class _Workers:
    """The leader's side: the worker processes and their results."""

    trust: Trust
    report: Report
    jobs: int
    body: Body
    timeout: float = WORKER_TIMEOUT  # seconds without progress: the worker is stuck
    workers: list[_Worker] = field(default_factory=list)
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
        except OSError as exc:  # out of processes, pipes or descriptors: no verdict
            self.stop()
            raise VerifyError(
                f"cannot start {self.jobs} verification workers ({exc.strerror or exc}); "
                "run with fewer --jobs"
            ) from None
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
        self._next = itertools.cycle(range(self.jobs))

    def poll(self) -> None:
        """Take what the workers sent so far, without waiting."""
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
        elif kind == "part":
            self.workers[worker].part = value
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
        """Wait for every worker's count, and add them up."""
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


# a worker's part of records.jsonl: its first byte, its end and the number of its first
# line; and the thread ids its range of threads starts at and ends before (None: open)
_Range = tuple[int, int, int, str | None, str | None]


@dataclass(frozen=True)
class _BundlePart:
    """What a worker read of the bundle: the SHA-256 of its range of records.jsonl and
    (when it took checkpoints) of checkpoints.jsonl; the thread of the row on its first
    and last line (None: no row there); its first and last thread groups, and the
    first version of each thread's groups (whose order it checked within its range);
    and the threads its rows name."""

    sha256: str
    checkpoints_sha256: str | None
    first_row: str | None
    last_row: str | None
    first_group: tuple[str, int] | None
    last_group: str | None
    groups: dict[str, int]
    threads: set[str]


@dataclass(frozen=True)
class _Files:
    """The bundle's files as the leader opened them, before the workers fork: they read
    the same files through the same descriptors (``os.pread``), up to these sizes."""

    records: BinaryIO
    records_size: int
    checkpoints: BinaryIO | None
    checkpoints_size: int


def verify_bundle_parallel(
    directory: Path,
    trust: Trust,
    report: Report,
    *,
    jobs: int,
    thread_id: str | None = None,
    worker_timeout: float = WORKER_TIMEOUT,
) -> Summary:
    """``ztate.services.verify.bundle.verify_bundle`` on ``jobs`` worker processes, each
    reading and verifying its own range of records.jsonl."""
    # both files opened before anything is reported: a file that is not a regular one
    # (a pipe) cannot be cut, and one process then verifies the whole bundle
    with contextlib.ExitStack() as opened:
        records = _open_regular(directory / RECORDS)
        if records is None:
            return verify_bundle(directory, trust, report, thread_id=thread_id)
        opened.enter_context(records)
        checkpoints: BinaryIO | None = None
        if trust.checkpoint_keys is not None:  # checked if the bundle carries them
            checkpoints = _open_regular(directory / CHECKPOINTS)
            if checkpoints is None:
                opened.close()
                return verify_bundle(directory, trust, report, thread_id=thread_id)
            opened.enter_context(checkpoints)
        leader = Verification(trust, report)  # the leader's own findings, headless threads
        manifest = usable_manifest(directory, leader)
        if not checks_checkpoints(leader.trust, manifest):  # a format 1 bundle
            checkpoints = None
        files = _Files(records, _size(records), checkpoints, _size(checkpoints))
        return _verify_ranges(
            directory, leader, report, manifest, files, jobs, thread_id, worker_timeout
        )


def _verify_ranges(
    directory: Path,
    leader: Verification,
    report: Report,
    manifest: Manifest,
    files: _Files,
    jobs: int,
    thread_id: str | None,
    worker_timeout: float,
) -> Summary:
    # with --thread, one range: the filter verifies one chain, which no cut may split
    cuts = _cuts(files.records, files.records_size, jobs) if thread_id is None else []
    body = functools.partial(_work_bundle, directory, manifest, files, thread_id)
    workers = _Workers(leader.trust, report, jobs, body=body, timeout=worker_timeout)
    try:
        read, hashes = _hand_out(directory, files, cuts, workers, thread_id)
        checkpoints_sha256 = _check_checkpoints(directory, manifest, leader, files, workers)
        counted = workers.finish()
    except BaseException:
        workers.stop()
        raise
    parts: list[_BundlePart] = []
    for number, expected in enumerate(hashes):
        part = workers.workers[number].part
        assert part is not None  # every worker with a range sends its part before its count
        if part.sha256 != expected:
            raise _changed(directory / RECORDS, _other_bytes(number, jobs))
        if part.checkpoints_sha256 != checkpoints_sha256:
            raise _changed(directory / CHECKPOINTS, _other_bytes(number, jobs))
        parts.append(part)
    for number, (_, owner) in enumerate(cuts, 1):  # each cut still between two threads
        before, after = parts[number - 1].last_row, parts[number].first_row
        if before is None or after != owner or before >= owner:
            raise _changed(
                directory / RECORDS,
                f"the cut before worker {number + 1} of {jobs} is no longer between two threads",
            )
    order = ThreadOrder(leader.finding)
    threads: set[str] = set()
    for part in parts:  # the order of the groups across ranges (each checked its own)
        threads |= part.threads
        if part.first_group is not None:
            first, version = part.first_group
            if first in order.seen:
                order.resumed(first, version)
            elif order.last is not None and first < order.last:
                order.after(first, version, order.last)
            for owner, version in part.groups.items():
                if owner != first and owner in order.seen:
                    order.resumed(owner, version)
            order.seen.update(part.groups)
            order.last = part.last_group
    check_records_file(manifest, read, len(threads), leader.finding)
    finish_bundle(leader, manifest, order.seen, thread_id)
    summary = leader.summary
    summary.threads += counted.threads
    summary.records += counted.records
    summary.failures += counted.failures
    return summary


def _changed(path: Path, why: str) -> VerifyError:
    return VerifyError(
        f"{path} changed while it was verified ({why}): the ledger is NOT verified; "
        "verify a copy nothing writes to"
    )


def _other_bytes(worker: int, jobs: int) -> str:
    return f"worker {worker + 1} of {jobs} read other bytes than the leader"


def _open_regular(path: Path) -> BinaryIO | None:
    """``path`` opened for reading if it is a regular file, else None (then one process
    reads it: a pipe cannot be cut, and a missing file is its error to report)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        handle = path.open("rb")
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):  # replaced since: one process
        handle.close()
        return None
    return handle


def _size(handle: BinaryIO | None) -> int:
    return os.fstat(handle.fileno()).st_size if handle is not None else 0


def _cuts(handle: BinaryIO, size: int, jobs: int) -> list[tuple[int, str]]:
    """Where the ranges after the first begin: the offset of a line that starts a
    thread group at or after an equal share of the file, and its thread; thread ids
    ascend from cut to cut. Fewer cuts where a share holds no boundary (one long
    thread); none if the file cannot be read (the leader's read says why)."""
    cuts: list[tuple[int, str]] = []
    try:
        for share in range(1, jobs):
            start = max(size * share // jobs, cuts[-1][0] + 1 if cuts else 0)
            cut = _boundary(handle, start, size * (share + 1) // jobs, cuts)
            if cut is not None:
                cuts.append(cut)
    except OSError:
        return []
    return cuts


def _boundary(
    handle: BinaryIO, start: int, limit: int, cuts: list[tuple[int, str]]
) -> tuple[int, str] | None:
    """The first line starting in [``start``, ``limit``) that begins a thread group:
    it and the line before are rows, and its thread id is greater than theirs and than
    the last cut's."""
    if start > 0 and not _newline_in(handle, start - 1, limit):
        return None  # no line starts in the share: no cut (and no long line read)
    position = _line_start(handle, start - 1) if start > 0 else 0
    handle.seek(position)
    previous: bytes | None = None
    while position < limit:
        line, length = _bounded_line(handle)
        if not length:
            return None
        if previous is not None and line is not None and position >= start:
            owner = _new_group(previous, line, cuts[-1][1] if cuts else None)
            if owner is not None:
                return position, owner
        previous = line
        position += length
    return None


def _bounded_line(handle: BinaryIO) -> tuple[bytes | None, int]:
    """The line at the handle's position and its length; None for a line over
    ``MAX_LINE`` bytes (no row), read past in blocks, never held."""
    line = handle.readline(bundle.MAX_LINE + 1)
    if len(line) <= bundle.MAX_LINE or line.endswith(b"\n"):
        return line, len(line)
    length = len(line)
    while (rest := handle.readline(BLOCK)) and not rest.endswith(b"\n"):
        length += len(rest)
    return None, length + len(rest)


def _newline_in(handle: BinaryIO, start: int, end: int) -> bool:
    """Whether bytes [``start``, ``end``) of the file hold a newline."""
    handle.seek(start)
    while start < end:
        block = handle.read(min(BLOCK, end - start))
        if not block:
            return False
        if b"\n" in block:
            return True
        start += len(block)
    return False


def _line_start(handle: BinaryIO, offset: int) -> int:
    """Where the line holding byte ``offset`` begins: the scan for a cut reads it
    whole, as the line before a candidate that begins at ``offset + 1``."""
    end = offset
    while end > 0:
        step = min(BLOCK, end)
        handle.seek(end - step)
        at = handle.read(step).rfind(b"\n")
        if at != -1:
            return end - step + at + 1
        end -= step
    return 0


def _new_group(previous: bytes, line: bytes, after: str | None) -> str | None:
    """``line``'s thread id if it begins a new group after ``previous`` (both rows, the
    thread ids ascending, greater than ``after``), else None."""
    first, second = _LINE_START.match(previous), _LINE_START.match(line)
    if first is None or second is None or first[1] >= second[1]:
        return None
    before, row = _row_thread(previous), _row_thread(line)
    if before is None or row is None or before >= row or (after is not None and row <= after):
        return None
    return row


def _row_thread(line: bytes | None) -> str | None:
    """The thread of the row ``line`` holds; None if it holds none."""
    if line is None:
        return None
    try:
        return row_from_line(line).thread_id
    except LineProblem:
        return None


def _hand_out(
    directory: Path,
    files: _Files,
    cuts: list[tuple[int, str]],
    workers: _Workers,
    thread_id: str | None,
) -> tuple[Tally, list[str]]:
    """Read records.jsonl once, in blocks: its hash and lines, and each range's hash. Each
    worker is sent its range as the read reaches it (with the number of its first line);
    the workers without a range, None. A range must begin at a line's start in the bytes
    read: a file changed since it was cut gives no verdict."""
    starts = [0, *(offset for offset, _ in cuts)]
    ends = [*starts[1:], files.records_size]
    firsts: list[str | None] = [None, *(owner for _, owner in cuts)]
    read = Tally()
    hashers = [hashlib.sha256() for _ in starts]
    for surplus in range(len(starts), workers.jobs):
        workers.workers[surplus].share = "no thread"
        workers.post(surplus, None)
    path = directory / RECORDS
    handed = position = 0
    last = b"\n"  # the byte before the read's position

    def hand_out_reached() -> None:
        """Send every range that begins where the read is."""
        nonlocal handed
        while handed < len(starts) and starts[handed] <= position:
            if handed > 0 and last != b"\n":  # the read stops at every range's start
                raise _changed(
                    path, f"no line starts where worker {handed + 1} of {workers.jobs} was to begin"
                )
            low = firsts[handed]
            high = firsts[handed + 1] if handed + 1 < len(firsts) else None
            workers.workers[handed].share = _share_text(low, high, thread_id)
            workers.post(handed, (starts[handed], ends[handed], read.lines + 1, low, high))
            handed += 1

    files.records.seek(0)
    while position < files.records_size:  # what the workers read: no more
        try:
            block = files.records.read(min(BLOCK, files.records_size - position))
        except OSError as exc:  # before any range is sent if the first read fails
            raise read_failed(path, read.lines, exc) from None
        if not block:
            break
        while block:  # the block, cut where ranges begin
            hand_out_reached()
            taken = len(block) if handed == len(starts) else starts[handed] - position
            piece = block if taken >= len(block) else block[:taken]
            read.block(piece)
            hashers[handed - 1].update(piece)
            position += len(piece)
            last = piece[-1:]
            block = block[len(piece) :]
        workers.poll()  # take the workers' findings as they come
    try:  # one more byte: the end of the file must be where it was (and readable)
        more = files.records.read(1)
    except OSError as exc:
        raise read_failed(path, read.lines, exc) from None
    if more:
        raise _changed(path, f"more than the {files.records_size} bytes it had when cut")
    hand_out_reached()  # an empty file's one range
    _same_size(path, files.records, files.records_size)
    return read, [h.hexdigest() for h in hashers]


def _same_size(path: Path, handle: BinaryIO, size: int) -> None:
    """The file still has the size the workers read up to, or the run has no verdict."""
    now = os.fstat(handle.fileno()).st_size
    if now != size:
        raise _changed(path, f"{size} bytes when the run began, {now} bytes now")


class _Upto(io.RawIOBase):
    """The first ``size`` bytes of the file open as ``fd``, read with ``os.pread``
    (the descriptor's offset, which the workers share, is left alone)."""

    def __init__(self, fd: int, size: int, path: Path) -> None:
        self._fd, self._size, self._path, self._position = fd, size, path, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._size - self._position)
        if want == 0:  # one more byte: the end of the file must be where it was
            if os.pread(self._fd, 1, self._size):
                raise _changed(self._path, f"more than the {self._size} bytes it had")
            return 0
        data = os.pread(self._fd, want, self._position)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def _check_checkpoints(
    directory: Path, manifest: Manifest, leader: Verification, files: _Files, workers: _Workers
) -> str | None:
    """Read checkpoints.jsonl for what needs all of it (its hash, count, order and lines
    that are no checkpoint: the leader's findings); its SHA-256, which every worker must
    have read too. None when the run takes no checkpoints."""
    if files.checkpoints is None:
        return None
    read = Tally()
    path = directory / CHECKPOINTS
    handle = io.BufferedReader(_Upto(files.checkpoints.fileno(), files.checkpoints_size, path))
    for number, _ in enumerate(checkpoint_entries(handle, path, manifest, leader.finding, read)):
        if number % BATCH == 0:
            workers.poll()  # take the workers' findings as they come
    _same_size(path, files.checkpoints, files.checkpoints_size)
    return read.sha256


def _work_bundle(
    directory: Path,
    manifest: Manifest,
    files: _Files,
    thread_id: str | None,
    inbox: Connection,
    outbox: _Outbox,
    trust: Trust,
) -> None:
    """Verify this worker's range of records.jsonl (or nothing, if sent None), with the
    checkpoints of its threads when the run takes them."""
    run = Verification(trust, lambda finding: outbox.put("finding", finding))
    outbox.watch(run.summary)
    given: _Range | None = inbox.recv()
    if given is None:
        outbox.put("done", run.summary)
        return
    start, end, number, low, high = given
    checkpoints: CheckpointReader | None = None
    checkpoints_hasher = hashlib.sha256()
    if files.checkpoints is not None:
        entries = _checkpoints_between(directory, files, low, high, checkpoints_hasher, outbox)
        checkpoints = CheckpointReader(entries, run.finding, thread_id=thread_id)
    hasher = hashlib.sha256()
    path = directory / RECORDS
    lines = _range_lines(files.records.fileno(), path, (start, end, number), hasher)
    order = ThreadOrder(run.finding)  # within the range: across ranges, the leader's
    groups: dict[str, int] = {}  # in the order met: the first is the first group's

    def group(owner: str, version: int) -> None:
        order.group(owner, version)
        groups.setdefault(owner, version)

    threads = verify_lines(
        run, manifest, lines, checkpoints=checkpoints, thread_id=thread_id, group=group
    )
    if checkpoints is not None:
        checkpoints.finish()
    part = _BundlePart(
        sha256=hasher.hexdigest(),
        checkpoints_sha256=checkpoints_hasher.hexdigest() if checkpoints is not None else None,
        first_row=_row_thread(lines.first),
        last_row=_row_thread(lines.last),
        first_group=next(iter(groups.items()), None),
        last_group=order.last,
        groups=groups,
        threads=threads,
    )
    outbox.put("part", part)
    outbox.put("done", run.summary)


def _checkpoints_between(
    directory: Path,
    files: _Files,
    low: str | None,
    high: str | None,
    hasher: Any,
    outbox: _Outbox,
) -> Iterator[Checkpoint]:
    """The checkpoints of threads in [``low``, ``high``) in file order, all of
    checkpoints.jsonl hashed into ``hasher`` and every line counted as progress (lines
    that are no checkpoint are the leader's to report)."""
    assert files.checkpoints is not None
    whole = (0, files.checkpoints_size, 1)
    path = directory / CHECKPOINTS
    for _, line in _range_lines(files.checkpoints.fileno(), path, whole, hasher):
        outbox.scanned += 1
        try:
            entry = checkpoint_from_line(line)
        except LineProblem:
            continue
        if (low is None or entry[0] >= low) and (high is None or entry[0] < high):
            yield entry


def _range_lines(fd: int, path: Path, given: tuple[int, int, int], hasher: Any) -> LineReader:
    """The numbered lines of bytes [start, end) of the file open as ``fd`` (without
    their newlines), read with ``os.pread`` and hashed into ``hasher``; ``BundleError``
    if a read fails part way."""
    start, end, number = given
    return LineReader(_range_blocks(fd, (start, end)), number, path, hasher.update)


def _range_blocks(fd: int, span: tuple[int, int]) -> Iterator[bytes]:
    position, end = span
    while position < end:
        block = os.pread(fd, min(BLOCK, end - position), position)
        if not block:
            break
        position += len(block)
        yield block


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
