"""WatchThread: each new version of a thread, as the caller's view of it.

A stream first sends the versions newer than the one the caller names, then
sleeps on the process's one LISTEN connection (``OutcomeListener``) until the
thread commits again; it also re-reads every ``RECHECK_SECONDS``, which covers an
announcement lost while that connection was down. Commits are announced only for
threads some replica watches (NOTIFY serialises commits on a global lock): the
first stream of this process on a thread registers it in
``ztate.watched_threads``, the last one to end unregisters it. A commit racing
with the very first registration may wait for the re-read. Every message is projected to
the keys the caller may read, exactly as ``GetView``. A server holds at most
``max_streams`` streams at once and refuses more with ``TOO_MANY_STREAMS``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import orjson

from services import errors
from services.canonical import canonical_bytes
from services.identity import Identity
from services.store.transitions import TransitionStore, VersionState
from transition_service.outcomes import OutcomeListener
from transition_service.reads import ThreadReads

log = logging.getLogger("ztate.transition")
BATCH = 100
RECHECK_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class WatchedVersion:
    thread_id: str
    version: int
    digest: str
    state_json: bytes  # empty when pruned
    state_pruned: bool


class Watcher:
    """Serves WatchThread streams, at most ``max_streams`` at once."""

    def __init__(
        self,
        store: TransitionStore,
        reads: ThreadReads,
        listener: OutcomeListener,
        max_streams: int,
    ) -> None:
        self._store = store
        self._reads = reads
        self._listener = listener
        self._max_streams = max_streams
        self._active = 0
        self._replica = uuid.uuid4().hex
        self._watched: Counter[str] = Counter()
        self._registering = asyncio.Lock()
        self._closing = False

    def shutdown(self) -> None:
        """End every stream now (they complete with OK; clients resume elsewhere) and
        refuse new ones, so that stopping the server does not wait on them."""
        self._closing = True
        self._listener.wake_all_watchers()

    @property
    def active(self) -> int:
        """Streams open now."""
        return self._active

    async def open(self, caller: Identity, thread_id: str, from_version: int) -> Subscription:
        """Check access and take a stream slot; ``Subscription.close`` gives it back."""
        if from_version < -1:
            raise errors.RequestInvalid("from_version must be >= -1")
        if self._closing:
            raise errors.TooManyStreams(
                "this server is shutting down; watch on another replica", limit=0
            )
        if self._active >= self._max_streams:
            raise errors.TooManyStreams(
                f"this server already serves {self._max_streams} watch streams; retry later",
                limit=self._max_streams,
            )
        self._active += 1  # taken before any await, so concurrent calls cannot overshoot
        try:
            readable = await self._reads.readable(caller, thread_id)
            await self._register(thread_id)
        except BaseException:
            self._active -= 1
            raise
        return Subscription(self, thread_id, from_version, readable)

    async def _register(self, thread_id: str) -> None:
        async with self._registering:
            self._watched[thread_id] += 1
            if self._watched[thread_id] == 1:
                try:
                    await self._store.watch_thread(thread_id, self._replica)
                except BaseException:
                    del self._watched[thread_id]
                    raise

    async def _release(self, thread_id: str) -> None:
        self._active -= 1
        async with self._registering:
            self._watched[thread_id] -= 1
            if self._watched[thread_id] > 0:
                return
            del self._watched[thread_id]
            try:
                await self._store.unwatch_thread(thread_id, self._replica)
            except Exception as failure:  # a stale row only costs announcements
                log.warning("could not unregister a watched thread: %s", type(failure).__name__)

    async def versions(
        self, thread_id: str, last: int, readable: frozenset[str] | None
    ) -> AsyncGenerator[WatchedVersion, None]:
        """Versions newer than ``last``, in order, forever."""
        async with self._listener.watching_thread(thread_id) as announced:
            while not self._closing:
                announced.clear()
                batch = await self._store.versions_after(thread_id, last, BATCH)
                for found in batch:
                    yield project(thread_id, found, readable)
                    last = found.version
                if len(batch) == BATCH:
                    continue
                try:
                    await asyncio.wait_for(announced.wait(), RECHECK_SECONDS)
                except TimeoutError:
                    continue


class Subscription:
    """One open stream: iterate it for the versions; ``close`` frees its slot."""

    def __init__(
        self, watcher: Watcher, thread_id: str, last: int, readable: frozenset[str] | None
    ) -> None:
        self._watcher = watcher
        self._thread_id = thread_id
        self._versions = watcher.versions(thread_id, last, readable)
        self._open = True

    def __aiter__(self) -> AsyncIterator[WatchedVersion]:
        return self._versions

    async def close(self) -> None:
        if self._open:
            self._open = False
            await self._versions.aclose()
            await self._watcher._release(self._thread_id)


def project(thread_id: str, found: VersionState, readable: frozenset[str] | None) -> WatchedVersion:
    """One version as the caller may see it: only the keys it may read."""
    if found.state is None:
        return WatchedVersion(thread_id, found.version, found.digest, b"", True)
    state = orjson.loads(found.state)
    if readable is not None:
        state = {key: state[key] for key in state.keys() & readable}
    return WatchedVersion(thread_id, found.version, found.digest, canonical_bytes(state), False)
