"""Group commit: proposals that arrive together commit in one statement and one WAL flush.

Each commit of the transition store (``PostgresTransitionStore.commit``) is queued
here. When no statement is running, a commit leaves at once, alone, as the one-row
statement it always was (``COMMIT``): nothing waits for company, so a lone writer's
latency is unchanged; and while each statement running carries one row, a commit takes
a free slot of the ``max_in_flight`` at once too (two writers do not wait for each
other). Otherwise (every slot busy, or a statement running carries several rows: the
service is under load) the commits that arrive wait, and leave all together (up to
``max_batch``) as ONE statement (``GROUP_COMMIT``: one round trip, one transaction,
one WAL flush for the lot) when a slot frees and the rule lets them: when the
multi-row statement ends, or at once when a full batch waits, or when the oldest has
waited ``GRACE_SECONDS`` (so that a free slot does not stay idle behind a statement held
up by a lock, a lost connection or a slow flush; with two slots that buys one more
statement, and two held-up statements hold everything, as before this rule). Under
load the batches thus grow with the arrival rate instead of splitting between the
slots: at 32 writers about seven rows a statement instead of three, and the
statement's cost (its call, plan start-up, commit and WAL flush) shared by them
(docs/performance.md, "Issue 19, seventh round"). The price is in the tail: a commit
that arrives while a batch runs waits for it (p99 68.5 against 55.1 ms at 32 writers,
one run each).

Inside that statement every row keeps its own outcome, exactly the one-row statement's:
its own compare-and-swap on its thread's version and digest (and, when it commits, the
nodes it wakes and its thread's wake mark, migration 0018), its own idempotency key
(taken by a committed request: ``KEY_TAKEN``; by a parked one: the CAS refuses it), so
one stale row never fails another. A commit made under a lease (a SubscribeWork
worker's, migration 0019) leaves alone, in the one-row statement, which fences and
releases the lease in its transaction; it waits by the same rule as any other. A batch
holds at most one commit per thread (a
second waits for the next batch, as it would have lost the race anyway or follows the
first), and locks its threads' heads in thread-id order before updating them, so that
two batches never deadlock. A commit is answered only when the statement that holds it
has returned, that is after Postgres committed it: an acknowledged commit is durable
exactly as before, and a crash before the answer leaves the whole batch committed or
none of it (the callers retry with their idempotency keys).

If the batch statement fails (an idempotency key taken by a concurrent commit between
its snapshot and its insert, or any error of one row), its rows are committed again one
by one with the one-row statement, so that the failure stays the failing row's.

The batch statement runs inside ``ztate.commit_batch`` (migration 0020), planned to probe
every table by index: a connection keeps one generic plan for it, and one made while the
tables were small would otherwise read whole tables on every batch as the ledger grows.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from ztate.services.store.interface import Commit

# One row's parameters, in COMMIT's order ($1..$16: then the nodes it wakes, and the node
# and epoch of the lease it was proposed under, both None for none; migration 0019).
CommitArgs = tuple[
    str,
    int,
    int,
    str,
    bytes,
    str,
    str,
    str,
    str,
    datetime,
    bytes,
    str | None,
    str | None,
    list[str],
    str | None,
    int | None,
]

# The batch statement (migration 0020: the statement of migration 0018's group commit,
# inside a function whose planner settings make every plan probe by index, whatever the
# statistics when the connection's generic plan was made). $1..$13: the rows' columns,
# in CommitArgs' order; $14, $15: the wakes, flattened (the row's ordinal, the node).
GROUP_COMMIT = (
    "SELECT n, committed, key_taken, watched FROM ztate.commit_batch($1, $2, $3, $4, $5, $6, "
    "$7, $8, $9, $10, $11, $12, $13, $14, $15)"
)  # a row per commit: n, its position in the batch (from 1), says whose answer it is


# How long waiting commits let a multi-row statement run before they take a free slot
# anyway: longer than a batch statement takes under load (a few milliseconds here), so
# that batches still grow; short enough that a statement held up (a lock, a connection
# lost, a slow flush) delays the others by no more than this.
GRACE_SECONDS = 0.025
# uvloop's clock moves by whole milliseconds: the grace is over within one of its due time
CLOCK_SLACK = 0.001


@dataclass(frozen=True, slots=True)
class Outcome:
    """One row's result: what the commit did, whether a replica watches its thread, and
    for a row under a lease that the commit released, whether more work waits."""

    commit: Commit
    watched: bool
    more: bool | None = None


@dataclass(slots=True)
class _Waiting:
    args: CommitArgs
    answer: asyncio.Future[Outcome]


def _leased(waiting: _Waiting) -> bool:
    """Whether the commit was proposed under a lease (its lease epoch, $16, is set)."""
    return waiting.args[15] is not None


class GroupCommitter:
    """Queues commits and sends them alone or together (see the module's doc)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        single: Callable[[CommitArgs], Awaitable[Outcome]],
        *,
        max_in_flight: int,
        max_batch: int,
        grace: float = GRACE_SECONDS,
    ) -> None:
        self._pool = pool
        self._single = single  # the one-row statement
        self._max_in_flight = max(1, max_in_flight)
        self._max_batch = max(1, max_batch)
        self._grace = grace
        # each statement running, and how many rows it carries (one, once a failed
        # batch commits its rows one by one)
        self._running: dict[asyncio.Task[None], int] = {}
        self._queue: list[_Waiting] = []
        self._waiting_since: float | None = None  # when the queue last became non-empty
        self._timer: asyncio.Handle | None = None  # the grace's, due at _timer_due
        self._timer_due: float | None = None

    async def commit(self, args: CommitArgs) -> Outcome:
        answer: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(args, answer))
        self._dispatch()
        return await answer

    def _slot_free(self) -> bool:
        """Whether the waiting commits may leave now. When no statement runs: at once.
        When a slot is free: while every statement running carries one row (light load:
        a second writer does not wait for the first), or once a full batch waits, or once
        the oldest has waited ``grace`` (a statement held up by a lock, a lost
        connection or a slow flush holds no one back longer). Otherwise (load) they wait
        for the statement running to end, and leave with every commit that arrived
        meanwhile: batches grow with the load instead of splitting between the slots."""
        if not self._running:
            return True
        if len(self._running) >= self._max_in_flight:
            return False
        if all(rows == 1 for rows in self._running.values()):
            return True
        if len(self._queue) >= self._max_batch:
            return True
        since = self._waiting_since
        now = asyncio.get_running_loop().time()
        return since is not None and now - since >= self._grace - CLOCK_SLACK

    def _dispatch(self) -> None:
        """Start statements while commits wait and the rule lets them; otherwise make
        sure the grace timer will look again."""
        loop = asyncio.get_running_loop()
        if self._queue and self._waiting_since is None:
            self._waiting_since = loop.time()
        while self._queue and self._slot_free():
            if not self._start():
                break
        if not self._queue:
            self._waiting_since = None
        due = None
        since = self._waiting_since  # set whenever commits wait
        if since is not None and self._running and len(self._running) < self._max_in_flight:
            # never sooner than a clock tick away: a timer that fires before the grace
            # is seen over would be armed again at once, round after round
            due = max(since + self._grace, loop.time() + CLOCK_SLACK)
        if self._timer is not None and due != self._timer_due:
            self._timer.cancel()
            self._timer = None
        if due is not None and self._timer is None:
            # uvloop answers a time already past with a plain Handle (no when()): the
            # time is kept here
            self._timer, self._timer_due = loop.call_at(due, self._grace_over), due

    def _grace_over(self) -> None:
        self._timer = None
        self._dispatch()

    def _start(self) -> bool:
        batch = self._take()
        self._waiting_since = asyncio.get_running_loop().time() if self._queue else None
        if not batch:
            return False
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._running[task] = len(batch)
        task.add_done_callback(functools.partial(self._sent, batch))
        return True

    def _take(self) -> list[_Waiting]:
        """Up to ``max_batch`` waiting commits, at most one per thread, oldest first; a
        commit under a lease always alone (GROUP_COMMIT neither fences nor releases
        leases: the one-row statement does)."""
        batch: list[_Waiting] = []
        later: list[_Waiting] = []
        threads: set[str] = set()
        for waiting in self._queue:
            thread_id = waiting.args[0]
            if waiting.answer.done():  # its caller was cancelled: nothing to send
                continue
            if not batch or (
                not _leased(batch[0])  # a leased first commit leaves alone
                and not _leased(waiting)
                and len(batch) < self._max_batch
                and thread_id not in threads
            ):
                threads.add(thread_id)
                batch.append(waiting)
            else:
                later.append(waiting)
        self._queue = later
        return batch

    def _sent(self, batch: list[_Waiting], task: asyncio.Task[None]) -> None:
        del self._running[task]
        if task.cancelled():
            # cancelled before its first step (the service stopping), _send never ran
            # to answer its callers: they are cancelled too, not left waiting
            for waiting in batch:
                waiting.answer.cancel()
        if self._queue:
            self._dispatch()

    async def _send(self, batch: list[_Waiting]) -> None:
        try:
            if len(batch) == 1:
                outcomes = [await self._one(batch[0].args)]
            else:
                outcomes = await self._together(batch)
        except Exception as failure:  # every caller of the batch gets the failure
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(failure)
            return
        except BaseException:  # cancelled (the service stops): so are its callers
            for waiting in batch:
                waiting.answer.cancel()
            raise
        for waiting, outcome in zip(batch, outcomes, strict=True):
            if not waiting.answer.done():
                waiting.answer.set_result(outcome)

    async def _one(self, args: CommitArgs) -> Outcome:
        return await self._single(args)

    async def _together(self, batch: list[_Waiting]) -> list[Outcome]:
        # a row's first 13 arguments unnest as columns; its wakes (the 14th) are flattened
        columns = list(zip(*(waiting.args[:13] for waiting in batch), strict=True))
        woken = [(n, node) for n, w in enumerate(batch, start=1) for node in w.args[13]]
        try:
            rows = await self._pool.fetch(
                GROUP_COMMIT, *columns, [n for n, _ in woken], [node for _, node in woken]
            )
        except asyncpg.PostgresError:
            # one row's failure (a key taken since the snapshot, a constraint) must stay
            # that row's: each commits again alone, in the one-row statement (one row
            # running at a time, as far as the slot rule is concerned)
            task = asyncio.current_task()
            if task in self._running:
                self._running[task] = 1
                self._dispatch()
            return [await self._one(waiting.args) for waiting in batch]
        by_position = {row["n"]: row for row in rows}
        return [
            Outcome(
                Commit.COMMITTED
                if row["committed"]
                else Commit.KEY_TAKEN
                if row["key_taken"]
                else Commit.HEAD_MOVED,
                row["watched"],
            )
            for row in (by_position[n] for n in range(1, len(batch) + 1))
        ]
