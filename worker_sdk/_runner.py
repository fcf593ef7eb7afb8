"""A node as a function from its view to a patch, driven by the thread's changes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypedDict, Unpack

from ztate.worker_sdk.client import Outcome, Transition, View, WorkItem, ZtateClient
from ztate.worker_sdk.errors import (
    AwaitingApproval,
    LeaseLost,
    ProtocolError,
    StaleVersion,
    Unavailable,
    ZtateError,
)

log = logging.getLogger("ztate.worker_sdk.runner")

Patch = dict[str, Any]
# serve: WaitForOutcome calls at once for parked proposals (each holds a stream of the
# client's one channel, for up to approval_wait; a server takes 256 streams at most)
MAX_OUTCOME_WAITS = 32
Handler = Callable[[View], Patch | Awaitable[Patch | None] | None]


class ServeOptions(TypedDict, total=False):
    """The options of a runner that serves all of its node's work (``NodeRunner.for_node``,
    ``SyncZtateClient.serve``): the ``NodeRunner`` fields of the same names, one list
    for both APIs."""

    node_name: str
    attempts: int
    approval_wait: float
    on_step: Callable[[Step], None] | None
    on_parked: Callable[[AwaitingApproval], None] | None
    concurrency: int
    shutdown_grace: float
    max_outcome_waits: int


@dataclass
class Step:
    """What one proposal of the runner became: ``status`` is "committed", "refused"
    (``error`` says why: nothing was written), or a parked transition's outcome
    ("rejected", "expired", "stale", "pending" when the wait ran out or there was
    none: see ``NodeRunner.serve``);
    ``transition`` is set once committed, ``digest`` once parked."""

    view_version: int
    patch: Patch
    status: str
    transition: Transition | None = None
    digest: str | None = None
    error: ZtateError | None = None
    thread_id: str = ""


@dataclass
class NodeRunner:
    """Runs ``handler`` for node ``node_name`` on every new version of ``thread_id``.

    For each version the node can see (from ``WatchThread``) the handler gets the
    view and returns a patch to propose, or None to do nothing. A proposal beaten
    by another writer (stale) is re-run on a fresh view, up to ``attempts`` times;
    a proposal parked for approval is waited for (``approval_wait`` seconds) and
    its outcome recorded; a refused proposal is recorded as "refused" and the
    node carries on with the next version (transport failures, ``Unavailable``,
    are raised). Versions at or below the last one the node saw or committed are
    skipped, so a handler never sees an older view than the last one it saw:
    the node's own commits do not reach its handler, nor do versions that were
    buffered while it waited for an approval and that the outcome superseded (a
    parked proposal whose base moved comes back "stale" and is re-run on a fresh
    ``get_view``, so the handler then sees the latest state). A backlog of
    versions is handled one by one, each with its own view; a proposal on one
    that is no longer the head is stale and re-run on the latest. ``steps`` records
    every proposal and what became of it; ``on_step`` is called with each, and
    ``on_parked`` when a proposal is parked, before waiting for its outcome.
    """

    client: ZtateClient
    thread_id: str
    handler: Handler
    node_name: str = "node"
    from_version: int = -1
    attempts: int = 5
    approval_wait: float = 60.0
    on_step: Callable[[Step], None] | None = None
    on_parked: Callable[[AwaitingApproval], None] | None = None
    steps: list[Step] = field(default_factory=list)
    concurrency: int = 1
    shutdown_grace: float = 10.0
    max_outcome_waits: int = MAX_OUTCOME_WAITS
    _seen: int = field(default=-1, init=False, repr=False)
    # serve: the waits for the outcomes of parked proposals (they hold no slot)
    _waiting: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)
    # serve: how far this machine's clock is ahead of the service's, plus the quickest
    # delivery seen (the least of "now here" minus "granted there"): an upper bound, so
    # a lease's age is never over-estimated by a clock that is merely off
    _clock_lead: float | None = field(default=None, init=False, repr=False)

    @classmethod
    def for_node(
        cls, client: ZtateClient, handler: Handler, **options: Unpack[ServeOptions]
    ) -> NodeRunner:
        """A runner that serves all of its node's work (``serve``), not one thread."""
        return cls(client, "", handler, **options)

    async def serve(self, stop: asyncio.Event | None = None) -> list[Step]:
        """Serve every thread on which the node has work (``SubscribeWork``) until
        ``stop`` is set or the task is cancelled; returns the steps.

        Up to ``concurrency`` handlers run at once, each on the node's projection of
        the head it was handed, under a lease that is renewed while it runs and
        released when it proposes (or returns None, or is refused). The next item is
        read only once a slot is free, and a handler starts only on a lease still held:
        one that spent half its TTL or more on the way (the stream was granted more
        than this process could start) is renewed first, and dropped if it lapsed. A proposal parked
        for approval frees its slot at once (the service released its lease when it
        parked it): its outcome is waited for (``approval_wait``) beside the handlers
        and recorded as a step, and ``on_parked`` is called first. At most
        ``max_outcome_waits`` (32) such waits run at once, one ``WaitForOutcome`` call
        each: a proposal parked while that many run is recorded "pending" at once, not
        waited for (the decision is taken without this process). On shutdown no
        new work is taken, running handlers get ``shutdown_grace`` seconds to
        finish, and the leases of those that did not are released undone, so that
        another process of the node takes them at once; waits for parked outcomes end
        at once, recorded "pending" (the decision is taken without this process). A
        handler that raises (or a service that cannot be reached) is logged with the
        exception's type, and its lease is left to lapse: the thread is handed out
        again after its TTL."""
        stop = stop or asyncio.Event()
        working: dict[asyncio.Task[None], WorkItem] = {}
        checking: list[WorkItem] = []  # read, its lease being checked before it starts
        room = asyncio.Semaphore(self.concurrency)

        async def take() -> None:
            # a free slot first, then the next item: an item is never held waiting for a
            # slot (its lease would lapse unrenewed, and its handler run on a lost lease)
            items = self.client.subscribe_work(max_in_flight=self.concurrency)
            async with contextlib.aclosing(items):
                while True:
                    await room.acquire()
                    try:
                        item = await anext(items)
                        checking.append(item)
                        live = await self._still_held(item)
                        checking.remove(item)
                    except StopAsyncIteration:
                        room.release()
                        return
                    except BaseException:
                        room.release()
                        raise
                    if not live:
                        room.release()
                        continue
                    task = asyncio.create_task(self._work_on(item))
                    working[task] = item
                    task.add_done_callback(finished)

        def finished(done: asyncio.Task[None]) -> None:
            working.pop(done, None)
            room.release()

        taking = asyncio.create_task(take())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({taking, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
            for item in checking:  # read but never started: given back undone
                with contextlib.suppress(ZtateError):
                    await self.client.release_lease(item.thread_id, item.lease_epoch, -1)
            if working:
                await asyncio.wait(set(working), timeout=self.shutdown_grace)
            for task, item in list(working.items()):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                with contextlib.suppress(ZtateError):
                    await self.client.release_lease(item.thread_id, item.lease_epoch, -1)
            waiting = list(self._waiting)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        if taking.done() and not taking.cancelled() and taking.exception() is not None:
            raise taking.exception()  # type: ignore[misc]
        return self.steps

    def _age(self, expires_at: datetime, ttl: float) -> float:
        """How long ago (seconds, by this machine's clock) the lease lapsing at
        ``expires_at`` (the service's clock) was granted or renewed, beyond the quickest
        delivery seen; 0 for the quickest. A clock that is off shifts every grant alike,
        so it cancels out: only a delivery that sat somewhere (the transport's buffer of
        a stream granted more than this process could start) looks old."""
        at = expires_at if expires_at.tzinfo is not None else expires_at.replace(tzinfo=UTC)
        lead = time.time() - (at.timestamp() - ttl)
        if self._clock_lead is None or lead < self._clock_lead:
            self._clock_lead = lead
        return lead - self._clock_lead

    async def _still_held(self, item: WorkItem) -> bool:
        """Whether ``item``'s handler may start: its lease has most of its TTL left, or
        renewing it now succeeds (one call). A lost lease is dropped, its handler never
        run (it would be fenced off after the work: ``LEASE_LOST``); one that cannot be
        renewed for another reason is given back undone."""
        if self._age(item.lease_expires_at, item.lease_ttl) < item.lease_ttl / 2:
            return True
        try:
            expires = await self.client.renew_lease(item.thread_id, item.lease_epoch)
        except LeaseLost:
            log.info(
                "%s: a lease lapsed before its handler could start; it is handed out again",
                self.node_name,
            )
            return False
        except ZtateError as failure:
            log.warning("%s: renewing a lease failed: %s", self.node_name, type(failure).__name__)
            with contextlib.suppress(ZtateError):
                await self.client.release_lease(item.thread_id, item.lease_epoch, -1)
            return False
        # a fresh reading of the service's clock: a step of this machine's clock since
        # the last reading is forgotten
        self._clock_lead = None
        self._age(expires, item.lease_ttl)
        return True

    async def _renew(self, item: WorkItem) -> None:
        """Keep the lease while the handler runs (a third of its TTL at a time)."""
        while True:
            await asyncio.sleep(max(item.lease_ttl / 3, 0.05))  # the renewal period
            try:
                await self.client.renew_lease(item.thread_id, item.lease_epoch)
            except LeaseLost:
                return  # the proposal will be fenced off
            except ZtateError as failure:
                log.warning("%s: renewing a lease failed: %s", self.node_name, failure)

    async def _work_on(self, item: WorkItem) -> None:
        renewing = asyncio.create_task(self._renew(item))
        done = False
        try:
            done = await self._lease_step(item)
        except Exception as failure:
            # the handler raised, or the service could not be reached: said here (the
            # type only: a message may hold state values), and the lease is kept until
            # it lapses, so that the work comes back after its TTL, not at once
            log.warning(
                "%s: handling thread %s failed (%s); it is handed out again once its lease lapses",
                self.node_name,
                item.thread_id,
                type(failure).__name__,
            )
            return
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
        if not done:
            with contextlib.suppress(LeaseLost):
                await self.client.release_lease(item.thread_id, item.lease_epoch, item.version)

    async def _lease_step(self, item: WorkItem) -> bool:
        """Handle one leased item; True when the lease ended with a proposal."""
        view = item.as_view()
        for attempt in range(self.attempts):
            patch = await self._patch_for(view)
            if patch is None:
                return False
            key = f"{self.node_name}-{view.version}-{uuid.uuid4().hex[:12]}"
            try:
                committed = await self.client.propose(
                    item.thread_id,
                    view.version,
                    patch,
                    idempotency_key=key,
                    lease_epoch=item.lease_epoch,
                )
            except StaleVersion:
                if attempt == self.attempts - 1:
                    return False
                view = await self.client.get_view(item.thread_id)
                continue
            except LeaseLost:
                log.info("%s: lease lost on a thread; another process has it", self.node_name)
                return True
            except (Unavailable, ProtocolError):  # not a refusal: nothing was decided
                raise
            except ZtateError as refused:
                self._refused(view, patch, refused)
                return False
            except AwaitingApproval as parked:
                # Parked, the lease is released (handled up to the view's version) and
                # the slot is freed: holding it while a reviewer decides would keep the
                # node from all other work for up to approval_wait. Whatever the
                # decision, nothing is left for this lease to do: an approval commits
                # as this node (its own commit does not wake it), and the version that
                # makes it stale is a new version, which wakes the node if it changed
                # what the node waits on.
                if self.on_parked is not None:
                    self.on_parked(parked)
                if len(self._waiting) >= self.max_outcome_waits:
                    # bounded: one call per wait, each for up to approval_wait
                    self._record(view, patch, Outcome("pending"), parked.digest or None)
                    return True
                waiting = asyncio.create_task(self._outcome_of(view, patch, parked))
                self._waiting.add(waiting)
                waiting.add_done_callback(self._waiting.discard)
                return True
            self._record(view, patch, Outcome("committed", committed), None)
            return True
        return False

    async def _outcome_of(self, view: View, patch: Patch, parked: AwaitingApproval) -> None:
        """Wait for a parked proposal's outcome (serve) and record it."""
        try:
            outcome = await self.client.wait_for_outcome(parked, within=self.approval_wait)
        except asyncio.CancelledError:
            self._record(view, patch, Outcome("pending"), parked.digest or None)  # shutdown
            raise
        except Exception as failure:
            log.warning(
                "%s: waiting for the outcome of a parked proposal on thread %s failed (%s)",
                self.node_name,
                view.thread_id,
                type(failure).__name__,
            )
            return
        self._record(view, patch, outcome, parked.digest or None)

    async def run(self, *, stop_after: int | None = None) -> list[Step]:
        """Watch the thread and act on it until cancelled, or until ``stop_after``
        proposals were made; returns the steps. The server ends every watch stream
        after its maximum lifetime: ``ZtateClient.watch`` resumes from the last version,
        so the runner goes on (a transport failure past its reconnects is raised)."""
        self._seen = self.from_version
        async for event in self.client.watch(self.thread_id, self.from_version):
            if event.version <= self._seen:
                continue
            view = event.as_view() or await self.client.get_view(self.thread_id)
            await self.handle(view)
            if stop_after is not None and len(self.steps) >= stop_after:
                break
        return self.steps

    async def handle(self, view: View) -> Step | None:
        """Run the handler on ``view`` and carry its patch through to an outcome."""
        for attempt in range(self.attempts):
            self._seen = max(self._seen, view.version)
            patch = await self._patch_for(view)
            if patch is None:
                return None
            key = f"{self.node_name}-{view.version}-{uuid.uuid4().hex[:12]}"
            try:
                committed = await self.client.propose(
                    self.thread_id, view.version, patch, idempotency_key=key
                )
            except StaleVersion:
                if attempt == self.attempts - 1:
                    raise
                view = await self.client.get_view(self.thread_id)
                continue
            except (Unavailable, ProtocolError):  # not a refusal: nothing was decided
                raise
            except ZtateError as refused:
                log.info("%s: refused: %s", self.node_name, refused)
                return self._refused(view, patch, refused)
            except AwaitingApproval as parked:
                log.info("%s: parked %s", self.node_name, parked.handle or parked.digest)
                if self.on_parked is not None:
                    self.on_parked(parked)
                outcome = await self.client.wait_for_outcome(parked, within=self.approval_wait)
                step = self._record(view, patch, outcome, parked.digest or None)
                if outcome.status == "stale" and attempt < self.attempts - 1:
                    view = await self.client.get_view(self.thread_id)
                    continue
                return step
            return self._record(view, patch, Outcome("committed", committed), None)
        return None

    def _refused(self, view: View, patch: Patch, error: ZtateError) -> Step:
        step = Step(view.version, patch, "refused", error=error, thread_id=view.thread_id)
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
        return step

    async def _patch_for(self, view: View) -> Patch | None:
        produced = self.handler(view)
        if inspect.isawaitable(produced):
            produced = await produced
        return produced

    def _record(self, view: View, patch: Patch, outcome: Outcome, digest: str | None) -> Step:
        step = Step(
            view.version, patch, outcome.status, outcome.transition, digest, None, view.thread_id
        )
        if outcome.transition is not None:
            self._seen = max(self._seen, outcome.transition.version)
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
        return step


async def run_node(
    client: ZtateClient,
    thread_id: str,
    handler: Handler,
    *,
    node_name: str = "node",
    from_version: int = -1,
    stop_after: int | None = None,
    approval_wait: float = 60.0,
    on_step: Callable[[Step], None] | None = None,
) -> list[Step]:
    """Run ``handler`` as node ``node_name`` on ``thread_id`` (see ``NodeRunner``)."""
    runner = NodeRunner(
        client,
        thread_id,
        handler,
        node_name=node_name,
        from_version=from_version,
        approval_wait=approval_wait,
        on_step=on_step,
    )
    return await runner.run(stop_after=stop_after)
