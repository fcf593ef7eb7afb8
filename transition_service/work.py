"""Workers find their work: wakes, leases and SubscribeWork (docs/work.md).

Three parts, one of each per process:

- Every commit decides whom its version wakes (the policy's wake declarations,
  ``Policy.woken``, evaluated by the use case before it commits) and records it with
  the version (migration 0018); the store announces the woken nodes on
  ``ztate_work`` to every replica. ``Waker`` is what remains of deciding after the
  fact: a sweep that catches up threads whose wake mark is behind their head, which
  only threads committed before that migration can be (their versions are read back
  and decided; deciding twice changes nothing).
- ``WorkDispatcher`` hands work to the SubscribeWork streams of this process: woken
  by the announcements (the process's one LISTEN connection) and every
  ``poll_seconds`` (one query for every subscribed node together, which also finds
  leases that lapsed), it takes leases by compare-and-swap for streams that have
  room and queues the thread's projection on them. Idle streams cost nothing.
- ``Leases``: renewal, release, and the fencing of proposals made under a lease.

Every lease change is a CAS on the row in Postgres, so replicas need not agree on
anything else. A node is only ever handed threads of its own policy: a row of its work
on a thread of another policy (left by a renamed policy) is granted once, found out
before anything is sent, and retired.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

import orjson

from ztate.contract.canonical import canonical_bytes
from ztate.services.policy.model import PolicySet
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.telemetry import untraced
from ztate.services.runtime.thread_ids import check_thread_id
from ztate.services.store.interface import LeaseClaim, TransitionStore
from ztate.services.store.work import Lease, Waiting, WorkStore
from ztate.transition_service.checks import check_registered
from ztate.transition_service.outcomes import OutcomeListener

log = logging.getLogger("ztate.transition")
CHANGES_BATCH = 64
SWEEP_BATCH = 200
# The sweep for undecided wakes scans every thread. Since migration 0018 no commit leaves
# a thread behind, so it runs at start-up, after the LISTEN connection came back, once
# per SWEEP_EVERY poll periods while it keeps finding threads behind, and otherwise once
# per IDLE_SWEEP_SECONDS (docs/work.md).
SWEEP_EVERY = 10
IDLE_SWEEP_SECONDS = 3600.0
MAX_IN_FLIGHT = 256
DISPATCH_CONCURRENCY = 8  # lease grants in flight at once per process (pool connections)
LEASE_LOST = "this lease is no longer held"


def author_node(node_id: str) -> str | None:
    """The node name of a stored record's author (``spiffe://<td>/node/<name>``), else
    None; for the caller of a request, ``acting_node`` of its identity."""
    _, _, path = node_id.partition("://")
    parts = path.split("/")
    return parts[2] if len(parts) == 3 and parts[1] == "node" else None


def acting_node(caller: Identity) -> str | None:
    """The node an authenticated caller is (None for operators and services): the
    author whose own commits never wake it."""
    return caller.name if caller.role is Role.NODE else None


class Waker:
    """Decides after the fact whom versions wake (the sweep), and tells every replica."""

    def __init__(self, work: WorkStore, policies: PolicySet) -> None:
        self._work = work
        self._policies = policies
        self._local: list[asyncio.Event] = []

    def notify_locally(self, event: asyncio.Event) -> None:
        """Set ``event`` whenever this process recorded new work (no round trip)."""
        self._local.append(event)

    async def evaluate(self, thread_id: str) -> None:
        """Decide the wakes of every version after the thread's mark."""
        head = await self._work.progress(thread_id)
        if head is None:
            return
        policy = self._policies.get(head.policy_name)
        mark = head.evaluated_version
        if mark >= head.version:
            return
        woken: dict[str, int] = {}
        last = mark
        while policy is not None and policy.wakes and last < head.version:
            changes = await self._work.changes_after(thread_id, last, CHANGES_BATCH)
            if not changes:
                break
            for change in changes:
                state = orjson.loads(change.state) if change.state is not None else {}
                for node in policy.woken(change.changed, state, author_node(change.node_id)):
                    woken[node] = change.version
                last = change.version
        await self._work.record_wakes(thread_id, sorted(woken.items()), max(last, head.version))
        if woken:
            await self._work.announce(sorted(woken))
            for event in self._local:
                event.set()

    async def sweep(self) -> int:
        """Decide the wakes of threads whose head is ahead of their mark; how many
        were behind."""
        total = 0
        for _ in range(10):  # a bounded round; the next sweep goes on
            behind = await self._work.unevaluated(SWEEP_BATCH)
            for found in behind:
                await self.evaluate(found.thread_id)
            total += len(behind)
            if len(behind) < SWEEP_BATCH:
                break
        return total


@dataclass(eq=False)
class WorkStream:
    """One SubscribeWork stream: the leases it holds and the items queued for it."""

    caller: Identity
    capacity: int
    holder: str
    items: asyncio.Queue[WorkItem] = field(default_factory=asyncio.Queue)
    held: dict[tuple[str, int], float] = field(default_factory=dict)  # -> local expiry
    closed: bool = False
    # a round passed it over while its items waited: the round after it drains is due
    passed_over: bool = False

    @property
    def room(self) -> int:
        # a stream with items still waiting to be sent is granted nothing more until it
        # takes them: one that stops reading holds at most one round's grants, and once
        # their leases lapse they go to the node's other processes (before, it was
        # granted its threads again every lease period, a copy of each head queued each
        # time, without bound)
        if self.closed or not self.items.empty():
            return 0
        return self.capacity - len(self.held)


@dataclass(frozen=True, slots=True)
class WorkItem:
    thread_id: str
    version: int
    state_json: bytes
    epoch: int
    expires_at: datetime
    ttl: float
    head_digest: str  # empty unless the node reads records


class WorkDispatcher:
    """Hands this process's SubscribeWork streams their work, under leases."""

    def __init__(
        self,
        store: TransitionStore,
        work: WorkStore,
        policies: PolicySet,
        waker: Waker,
        listener: OutcomeListener,
        *,
        lease_seconds: float,
        poll_seconds: float,
        max_streams: int,
        per_identity: int,
        lifetime: float,
    ) -> None:
        self._store = store
        self._work = work
        self._policies = policies
        self._waker = waker
        self.lease_seconds = lease_seconds
        self._poll_seconds = poll_seconds
        self._max_streams = max_streams
        self._per_identity = per_identity
        self.lifetime = lifetime
        self._replica = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._streams: dict[str, list[WorkStream]] = {}
        self._by_identity: Counter[Identity] = Counter()
        self._wake = asyncio.Event()
        # nodes that may have more work waiting than they were granted: their last query
        # filled its limit, or work was announced since (a freed slot then asks for a
        # round at once, not at the next poll)
        self._backlog: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.polls = 0  # rounds that queried (for tests and diagnostics)
        self.sweeps = 0  # sweeps for undecided wakes (for tests and diagnostics)
        self.checks = 0  # checks of held slots against the database (tests, diagnostics)
        self.retired = 0  # rows of work on threads of another policy, retired
        self._next_check = 0.0
        self._sweep_due = True  # at start-up first
        listener.on_work(self._announced)
        listener.on_reconnect(self._reconnected)
        waker.notify_locally(self._wake)

    def start(self) -> None:
        with untraced():
            self._task = asyncio.create_task(self._run(), name="ztate-work-dispatcher")

    async def stop(self) -> None:
        """End every stream (their leases lapse or are released by their workers)."""
        self._closing = True
        for streams in self._streams.values():
            for stream in streams:
                stream.closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def active(self) -> int:
        return sum(len(s) for s in self._streams.values())

    async def _reconnected(self) -> None:
        """The LISTEN connection came back (the database may have failed over, or been
        upgraded under the service): sweep in the next round."""
        self._sweep_due = True
        self._wake.set()

    def _announced(self, node: str | None) -> None:
        if node is None:
            self._backlog.update(self._streams)
            self._wake.set()
        elif node in self._streams:
            self._backlog.add(node)
            self._wake.set()

    def open(self, caller: Identity, max_in_flight: int) -> WorkStream:
        """Check the caller may subscribe and take a stream slot."""
        if caller.role is not Role.NODE:
            raise errors.RoleForbidden(f"a {caller.role} identity has no work: nodes subscribe")
        policy = check_registered(caller, self._policies)
        if caller.name not in policy.wakes:
            raise errors.NoWakeDeclared(
                f"the policy declares no wake for node {caller.name!r}: it never has work"
            )
        if not 0 <= max_in_flight <= MAX_IN_FLIGHT:
            raise errors.RequestInvalid(f"max_in_flight must be 0-{MAX_IN_FLIGHT}")
        if self._closing:
            raise errors.TooManyStreams("this server is shutting down", limit=0)
        if self.active >= self._max_streams:
            raise errors.TooManyStreams(
                f"this server already serves {self._max_streams} streams", limit=self._max_streams
            )
        if self._by_identity[caller] >= self._per_identity:
            raise errors.TooManyStreams(
                f"this identity already holds {self._per_identity} streams on this server",
                limit=self._per_identity,
            )
        stream = WorkStream(caller, max_in_flight or 1, f"{self._replica}/{next(self._ids)}")
        self._by_identity[caller] += 1
        self._streams.setdefault(caller.name, []).append(stream)
        self._wake.set()
        return stream

    def close(self, stream: WorkStream) -> None:
        """The stream ended: its leases stay until released or lapsed."""
        stream.closed = True
        streams = self._streams.get(stream.caller.name, [])
        if stream in streams:
            streams.remove(stream)
            if not streams:
                del self._streams[stream.caller.name]
            self._by_identity[stream.caller] -= 1
            if self._by_identity[stream.caller] <= 0:
                del self._by_identity[stream.caller]

    async def give_back(self, stream: WorkStream, item: WorkItem) -> None:
        """Release, undone (``-1``), the lease of an item that was not sent: another
        process of the node takes the thread at once, not after the lease's TTL."""
        stream.held.pop((item.thread_id, item.epoch), None)
        await self._work.release(item.thread_id, stream.caller.name, item.epoch, -1)
        self._wake.set()

    def released(self, node: str, thread_id: str, epoch: int, *, more: bool = True) -> None:
        """A lease of ``node`` ended through this process: free its stream's slot, and
        ask for a round when the thread has more work for the node (``more``) or the
        node may have a backlog (before, a freed slot waited for the next poll: at most
        ``max_in_flight`` threads per poll period and stream under a backlog)."""
        freed = None
        for stream in self._streams.get(node, ()):
            if stream.held.pop((thread_id, epoch), None) is not None:
                freed = stream
                break
        if more or (freed is not None and freed.room > 0 and node in self._backlog):
            self._wake.set()

    def renewed(self, node: str, thread_id: str, epoch: int) -> None:
        loop = asyncio.get_running_loop()
        for stream in self._streams.get(node, ()):
            if (thread_id, epoch) in stream.held:
                stream.held[(thread_id, epoch)] = loop.time() + self.lease_seconds

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_sweep = loop.time()
        while True:
            try:
                if self._sweep_due or loop.time() >= next_sweep:
                    self._sweep_due = False
                    try:
                        behind = await self._waker.sweep()
                    except BaseException:
                        self._sweep_due = True  # the next round tries again
                        raise
                    self.sweeps += 1
                    # a clean sweep: nothing can fall behind since migration 0018 but
                    # a thread a pre-0018 replica committed, so the full scan is rare
                    period = SWEEP_EVERY * self._poll_seconds if behind else IDLE_SWEEP_SECONDS
                    next_sweep = loop.time() + period
                await self.dispatch()
            except Exception as failure:  # the next round tries again
                log.warning("work dispatch round failed: %s", type(failure).__name__)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
            # cancellation that lands as the wait ends, and stop() then waits forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_seconds):
                    await self._wake.wait()
            self._wake.clear()

    async def _check_held(self) -> None:
        """Check the streams' slots against the database, the truth: a renewal, a release
        or a commit under a lease may reach another replica (round-robin balancing,
        docs/scale-out.md), which tells this one nothing. Checked are the leases past
        their local expiry (before, forgotten unchecked: one renewed through another
        replica was still held, and the stream was granted beyond its max_in_flight),
        and once per poll period every lease of a node that may have a backlog (before,
        a lease released elsewhere kept its slot until its local expiry, up to a TTL).
        One query, and none when nothing is due."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        every = now >= self._next_check
        due: list[tuple[WorkStream, tuple[str, int]]] = []
        for node, streams in self._streams.items():
            for stream in streams:
                for key, expiry in stream.held.items():
                    if expiry < now or (every and node in self._backlog):
                        due.append((stream, key))
        if not due:
            return
        if every:
            self._next_check = now + self._poll_seconds
        self.checks += 1
        live = {
            (h.holder, h.thread_id, h.epoch): h.seconds_left
            for h in await self._work.held(
                sorted({key[0] for _, key in due}),
                sorted({stream.caller.name for stream, _ in due}),
                sorted({stream.holder for stream, _ in due}),
            )
        }
        now = loop.time()
        for stream, key in due:
            left = live.get((stream.holder, *key))
            if left is None:
                stream.held.pop(key, None)  # released, committed, lapsed or taken again
            elif key in stream.held:
                stream.held[key] = max(stream.held[key], now + left)

    async def dispatch(self) -> int:
        """One round: lease waiting work to streams with room; how many were handed out."""
        await self._check_held()
        for streams in self._streams.values():
            for stream in streams:
                if not stream.items.empty() and len(stream.held) < stream.capacity:
                    stream.passed_over = True  # its next drain asks for another round
        room = {
            node: sum(s.room for s in streams)
            for node, streams in self._streams.items()
            if any(s.room > 0 for s in streams)
        }
        if not room:
            return 0
        policies = {node: self._policies.of_node(node) for node in room}
        nodes = [(node, p.name) for node, p in policies.items() if p is not None]
        if not nodes:
            return 0
        self.polls += 1
        # cleared before the queries: work announced while they run stays marked
        self._backlog.difference_update(node for node, _ in nodes)
        # one query a node, each led by the index in its order (migration 0030), as many
        # at once as grants are (pool connections)
        grants = asyncio.Semaphore(DISPATCH_CONCURRENCY)

        async def ask(node: str) -> list[Waiting]:
            async with grants:
                return await self._work.waiting(node, room[node])

        per_node = await asyncio.gather(*(ask(node) for node, _ in nodes))
        waiting = [row for rows in per_node for row in rows]
        for (node, _), rows in zip(nodes, per_node, strict=True):
            if len(rows) >= room[node]:  # there may be more than was asked for
                self._backlog.add(node)
        # each found row goes to the stream of its node with the most room left; a
        # slot is reserved before the (concurrent) round trips, so no stream overfills
        reserved: Counter[int] = Counter()
        plan: list[tuple[WorkStream, Waiting]] = []
        for found in waiting:
            streams = [s for s in self._streams.get(found.node, ()) if s.room - reserved[id(s)] > 0]
            if streams:
                stream = max(streams, key=lambda s: s.room - reserved[id(s)])
                reserved[id(stream)] += 1
                plan.append((stream, found))

        async def hand(stream: WorkStream, found: Waiting) -> bool:
            async with grants:
                lease = await self._work.acquire(
                    found.thread_id, found.node, stream.holder, self.lease_seconds
                )
                if lease is None:
                    return False  # another process (or replica) took it first
                return await self._deliver(stream, lease)

        handed = await asyncio.gather(*(hand(stream, found) for stream, found in plan))
        return sum(handed)

    async def _deliver(self, stream: WorkStream, lease: Lease) -> bool:
        policy = self._policies.of_node(lease.node)
        head = await self._store.read_head(lease.thread_id)
        if head is None or policy is None or head.policy_name != policy.name:
            # never a thread of another policy (its policy renamed, the node moved to
            # another policy file): not its work, now or later, so retired (handled up to
            # the version that woke it) rather than given back undone, which put it back
            # ahead of the node's real work at every round; and a round at once, since the
            # slot it took is free again
            await self._work.release(lease.thread_id, lease.node, lease.epoch, lease.wake_version)
            self.retired += 1
            self._wake.set()
            return False
        if stream.closed:  # give the lease back untouched: another stream takes it
            await self._work.release(lease.thread_id, lease.node, lease.epoch, -1)
            return False
        state = orjson.loads(head.state_bytes)
        readable = policy.readable(lease.node)
        projected = canonical_bytes({key: state[key] for key in state.keys() & readable})
        stream.held[(lease.thread_id, lease.epoch)] = (
            asyncio.get_running_loop().time() + self.lease_seconds
        )
        stream.items.put_nowait(
            WorkItem(
                lease.thread_id,
                head.version,
                projected,
                lease.epoch,
                lease.expires_at,
                self.lease_seconds,
                head.digest if policy.reads_records(lease.node) else "",
            )
        )
        return True

    async def items(self, stream: WorkStream) -> AsyncIterator[WorkItem]:
        """The stream's items until its lifetime ends or the server stops."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.lifetime
        while not stream.closed and not self._closing:
            left = ends - loop.time()
            if left <= 0:
                return
            try:
                item = await asyncio.wait_for(stream.items.get(), min(left, 1.0))
            except TimeoutError:
                continue  # checks for the end of the stream; no database query
            if stream.passed_over and stream.items.empty():
                stream.passed_over = False
                self._wake.set()  # drained after a round gave it nothing: one more round
            if (item.thread_id, item.epoch) not in stream.held:
                continue  # its lease lapsed (or ended) before it was sent: it is lost
            yield item


class Leases:
    """Renewal, release and fencing of lease grants, for the caller's own node."""

    def __init__(self, work: WorkStore, dispatcher: WorkDispatcher) -> None:
        self._work = work
        self._dispatcher = dispatcher

    def _node(self, caller: Identity, thread_id: str, epoch: int) -> str:
        check_thread_id(thread_id)
        if epoch <= 0:
            raise errors.RequestInvalid("lease_epoch must be > 0")
        return caller.name if caller.role is Role.NODE else ""

    async def renew(self, caller: Identity, thread_id: str, epoch: int) -> datetime:
        node = self._node(caller, thread_id, epoch)
        expires = await self._work.renew(thread_id, node, epoch, self._dispatcher.lease_seconds)
        if expires is None:
            raise errors.LeaseLost(LEASE_LOST)
        self._dispatcher.renewed(node, thread_id, epoch)
        return expires

    async def release(
        self, caller: Identity, thread_id: str, epoch: int, handled_version: int
    ) -> None:
        node = self._node(caller, thread_id, epoch)
        if handled_version < -1:
            raise errors.RequestInvalid("handled_version must be >= -1")
        if not await self._give_back(thread_id, node, epoch, handled_version):
            raise errors.LeaseLost(LEASE_LOST)

    def claim(self, caller: Identity, thread_id: str, epoch: int) -> LeasedProposal:
        """A proposal of ``caller`` under grant ``epoch``: fenced before its first
        statement, or by its commit (docs/work.md, "Proposals under a lease")."""
        node = self._node(caller, thread_id, epoch)
        return LeasedProposal(thread_id, LeaseClaim(node, epoch), self._work.holds)

    async def finish(self, lease: LeasedProposal, handled_version: int) -> None:
        """The proposal was answered (committed, parked or replayed): the lease goes
        back, the node done with ``handled_version`` (the proposal's expected version,
        which the pipeline checked is >= 0); no round trip when its commit released it
        already. A grant that lost the lease meanwhile leaves it be."""
        claim = lease.claim
        if claim.settled:
            if claim.more is not None:
                self._dispatcher.released(claim.node, lease.thread_id, claim.epoch, more=claim.more)
            return
        await self._give_back(lease.thread_id, claim.node, claim.epoch, handled_version)

    async def _give_back(self, thread_id: str, node: str, epoch: int, handled_version: int) -> bool:
        """Release grant ``epoch``'s lease and free its stream's slot; False when that
        grant no longer held the lease (nothing changed)."""
        more = await self._work.release(thread_id, node, epoch, handled_version)
        if more is None:
            return False
        self._dispatcher.released(node, thread_id, epoch, more=more)
        return True


@dataclass(eq=False)
class LeasedProposal:
    """A proposal made under a lease grant, as the proposal pipeline fences it: once,
    before the first statement it sends, unless that statement is its commit or its
    park, which fences the lease in its own transaction (migrations 0019, 0024; a
    commit releases it too)."""

    thread_id: str
    claim: LeaseClaim
    _holds: Callable[[str, str, int], Awaitable[bool]]
    fenced: bool = False  # the fence passed, or the commit or park carrying it was sent

    async def fence(self) -> None:
        """Refuse with ``LeaseLost`` unless the grant still holds the lease."""
        if self.fenced:
            return
        if not await self._holds(self.thread_id, self.claim.node, self.claim.epoch):
            raise errors.LeaseLost(LEASE_LOST)
        self.fenced = True


@dataclass(frozen=True)
class Work:
    """The process's waker, dispatcher and leases, as the RPC layer uses them."""

    waker: Waker
    dispatcher: WorkDispatcher
    leases: Leases
