"""WatchThread: each new version of a thread, as the caller's view of it.

A stream first sends the versions newer than the one the caller names, then
sleeps on the process's one LISTEN connection (``OutcomeListener``) until the
thread commits again. An idle stream costs the database nothing: one task per
process re-reads, every ``RECHECK_SECONDS``, the heads of every thread its streams
watch in one query (``head_versions``) and wakes the streams that are behind, which
covers an announcement lost (a committer that died before announcing, a commit
racing with the first registration); a lost LISTEN connection wakes every stream
when it is back. Commits are announced, by the
replica that made them, only for threads some replica watches (NOTIFY serialises
on a global lock): the first stream of this process on a thread registers it in
``ztate.watched_threads`` under the LISTEN session's identity, the last one to end
unregisters it, and the listener sweeps rows of sessions that are gone. A commit
racing with the very first registration may wait for the re-read. Every message
is projected to the keys the caller may read, exactly as ``GetView``.

Limits: a server holds at most ``max_streams`` streams, and one identity at most
``per_identity``, refusing more with ``TOO_MANY_STREAMS``; a stream ends cleanly
(OK) after ``lifetime`` seconds, so that access is checked again when the client
resumes; versions are read ``BATCH`` at a time, since state bodies may be large.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson

from ztate.contract.canonical import canonical_bytes
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Identity
from ztate.services.store.interface import TransitionStore
from ztate.services.store.rows import VersionState
from ztate.transition_service.outcomes import OutcomeListener
from ztate.transition_service.reads import ThreadReads

if TYPE_CHECKING:
    from ztate.services.runtime.config import Settings

log = logging.getLogger("ztate.transition")
BATCH = 16
RECHECK_SECONDS = 2.0
RECHECK_BATCH = 1000  # threads per head query of the re-read


@dataclass(frozen=True, slots=True)
class WatchLimits:
    """How many streams a server and one identity may hold, and for how long."""

    max_streams: int
    per_identity: int = 32
    lifetime: float = 600.0


@dataclass(frozen=True, slots=True)
class WatchedVersion:
    thread_id: str
    version: int
    digest: str
    state_json: bytes  # empty when pruned
    state_pruned: bool


@dataclass(eq=False, slots=True)
class _Follower:
    """One stream waiting for its thread to move past ``last``."""

    thread_id: str
    last: int
    announced: asyncio.Event


@dataclass(slots=True)
class _ThreadLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Watcher:
    """Serves WatchThread streams within ``WatchLimits``."""

    def __init__(
        self,
        store: TransitionStore,
        reads: ThreadReads,
        listener: OutcomeListener,
        limits: WatchLimits | int,
    ) -> None:
        self._store = store
        self._reads = reads
        self._listener = listener
        self._limits = limits if isinstance(limits, WatchLimits) else WatchLimits(limits)
        self._active = 0
        self._by_identity: Counter[Identity] = Counter()
        self._watched: Counter[str] = Counter()
        # one lock per watched thread: registering one thread never waits on another's
        # database round trip
        self._locks: dict[str, _ThreadLock] = {}
        self._unwatching: set[asyncio.Task[None]] = set()
        self._followers: dict[str, set[_Follower]] = {}
        self._rechecker: asyncio.Task[None] | None = None
        self.rechecks = 0  # rounds of the re-read that queried (for tests)
        self._closing = False
        self.opened = 0  # streams opened since start (for tests and diagnostics)
        listener.on_reconnect(self._register_again)

    @classmethod
    def from_settings(
        cls,
        store: TransitionStore,
        reads: ThreadReads,
        listener: OutcomeListener,
        settings: Settings,
    ) -> Watcher:
        return cls(
            store,
            reads,
            listener,
            WatchLimits(
                settings.watch_max_streams,
                settings.watch_max_streams_per_identity,
                settings.watch_max_stream_seconds,
            ),
        )

    def shutdown(self) -> None:
        """End every stream now (they complete with OK; clients resume elsewhere) and
        refuse new ones, so that stopping the server does not wait on them."""
        self._closing = True
        self._listener.wake_all_watchers()
        if self._rechecker is not None:
            self._rechecker.cancel()
            self._rechecker = None

    def _ensure_rechecker(self) -> None:
        if self._rechecker is None and not self._closing:
            self._rechecker = asyncio.create_task(self._recheck(), name="ztate-watch-recheck")

    async def _recheck(self) -> None:
        """Every ``RECHECK_SECONDS``: one query for the heads of every followed thread
        (per ``RECHECK_BATCH``), then wake the streams that are behind."""
        while True:
            await asyncio.sleep(RECHECK_SECONDS)  # the re-read's period, not a sync
            threads = list(self._followers)
            for start in range(0, len(threads), RECHECK_BATCH):
                chunk = threads[start : start + RECHECK_BATCH]
                try:
                    heads = await self._store.head_versions(chunk)
                except Exception as failure:  # the next round tries again
                    log.warning("watch re-read failed: %s", type(failure).__name__)
                    break
                self.rechecks += 1
                for thread_id, version in heads.items():
                    for follower in self._followers.get(thread_id, ()):
                        if follower.last < version:
                            follower.announced.set()

    @property
    def active(self) -> int:
        """Streams open now."""
        return self._active

    def watched(self) -> dict[str, int]:
        """Streams per watched thread (for tests and diagnostics)."""
        return dict(self._watched)

    async def open(self, caller: Identity, thread_id: str, from_version: int) -> Subscription:
        """Check access and take a stream slot; ``Subscription.close`` gives it back."""
        if from_version < -1:
            raise errors.RequestInvalid("from_version must be >= -1")
        limits = self._limits
        if self._closing:
            raise errors.TooManyStreams(
                "this server is shutting down; watch on another replica", limit=0
            )
        if self._active >= limits.max_streams:
            raise errors.TooManyStreams(
                f"this server already serves {limits.max_streams} watch streams; retry later",
                limit=limits.max_streams,
            )
        if self._by_identity[caller] >= limits.per_identity:
            raise errors.TooManyStreams(
                f"this identity already holds {limits.per_identity} watch streams on this "
                "server; close one first",
                limit=limits.per_identity,
            )
        # taken before any await, so concurrent calls cannot overshoot
        self._active += 1
        self._by_identity[caller] += 1
        try:
            readable = await self._reads.readable(caller, thread_id)
            await self._register(thread_id)
        except BaseException:
            self._give_back(caller)
            raise
        self.opened += 1
        return Subscription(self, caller, thread_id, from_version, readable)

    def _give_back(self, caller: Identity) -> None:
        self._active -= 1
        self._by_identity[caller] -= 1
        if self._by_identity[caller] <= 0:
            del self._by_identity[caller]

    @contextlib.asynccontextmanager
    async def _thread_lock(self, thread_id: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(thread_id, _ThreadLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[thread_id]

    async def _register(self, thread_id: str) -> None:
        async with self._thread_lock(thread_id):
            self._watched[thread_id] += 1
            if self._watched[thread_id] > 1:
                return
            backend = self._listener.backend  # None while down: reconnecting registers
            try:
                if backend is not None:
                    await self._store.watch_thread(thread_id, backend)
            except BaseException:
                self._forget(thread_id)
                raise

    def _forget(self, thread_id: str) -> None:
        """One stream fewer on ``thread_id``: synchronous, so no cancellation can
        skip it; the row of the last one goes in a task of its own."""
        self._watched[thread_id] -= 1
        if self._watched[thread_id] > 0:
            return
        del self._watched[thread_id]
        task = asyncio.create_task(self._unwatch(thread_id))
        self._unwatching.add(task)
        task.add_done_callback(self._unwatching.discard)

    async def _unwatch(self, thread_id: str) -> None:
        async with self._thread_lock(thread_id):
            backend = self._listener.backend
            if self._watched[thread_id] > 0 or backend is None:
                return  # watched again meanwhile, or the session (and its rows) is gone
            try:
                await self._store.unwatch_thread(thread_id, backend)
            except Exception as failure:  # a stale row costs announcements until swept
                log.warning("could not unregister a watched thread: %s", type(failure).__name__)

    def _release(self, caller: Identity, thread_id: str) -> None:
        self._give_back(caller)
        self._forget(thread_id)

    async def _register_again(self) -> None:
        """After the LISTEN connection came back under a new session."""
        backend = self._listener.backend
        for thread_id in list(self._watched):
            async with self._thread_lock(thread_id):
                if self._watched[thread_id] > 0 and backend is not None:
                    await self._store.watch_thread(thread_id, backend)

    async def versions(
        self, thread_id: str, last: int, readable: frozenset[str] | None
    ) -> AsyncGenerator[WatchedVersion, None]:
        """Versions newer than ``last``, in order, until the stream's lifetime ends."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + self._limits.lifetime
        async with self._listener.watching_thread(thread_id) as announced:
            follower = _Follower(thread_id, last, announced)
            self._followers.setdefault(thread_id, set()).add(follower)
            self._ensure_rechecker()
            try:
                while not self._closing:
                    announced.clear()
                    batch = await self._store.versions_after(thread_id, last, BATCH)
                    for found in batch:
                        yield project(thread_id, found, readable)
                        last = follower.last = found.version
                    left = ends - loop.time()
                    if left <= 0:
                        return  # the client resumes, and its access is checked again
                    if len(batch) == BATCH:
                        continue
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(announced.wait(), left)
            finally:
                followers = self._followers.get(thread_id)
                if followers is not None:
                    followers.discard(follower)
                    if not followers:
                        del self._followers[thread_id]


class Subscription:
    """One open stream: iterate it for the versions; ``close`` frees its slot."""

    def __init__(
        self,
        watcher: Watcher,
        caller: Identity,
        thread_id: str,
        last: int,
        readable: frozenset[str] | None,
    ) -> None:
        self._watcher = watcher
        self._caller = caller
        self._thread_id = thread_id
        self._versions = watcher.versions(thread_id, last, readable)
        self._open = True

    @property
    def caller(self) -> Identity:
        return self._caller

    def __aiter__(self) -> AsyncIterator[WatchedVersion]:
        return self._versions

    async def close(self) -> None:
        if self._open:
            self._open = False
            # the slot and the count come back first, before any await that a
            # cancellation could interrupt
            self._watcher._release(self._caller, self._thread_id)
            await self._versions.aclose()


def project(thread_id: str, found: VersionState, readable: frozenset[str] | None) -> WatchedVersion:
    """One version as the caller may see it: only the keys it may read."""
    if found.state is None:
        return WatchedVersion(thread_id, found.version, found.digest, b"", True)
    state = orjson.loads(found.state)
    if readable is not None:
        state = {key: state[key] for key in state.keys() & readable}
    return WatchedVersion(thread_id, found.version, found.digest, canonical_bytes(state), False)
