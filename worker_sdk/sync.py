"""A blocking client for workers that are not written with asyncio.

It runs a private event loop on a background thread and forwards each call to
the asynchronous ``ZtateClient``; every method blocks until that call is done
and raises the same typed errors.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar, Unpack

from ztate.worker_sdk._runner import NodeRunner, ServeOptions, Step
from ztate.worker_sdk.client import (
    Checkpoint,
    HeadRecord,
    Outcome,
    Transition,
    View,
    WatchEvent,
    WorkItem,
    ZtateClient,
)
from ztate.worker_sdk.errors import AwaitingApproval

Result = TypeVar("Result")


class SyncZtateClient:
    """``ZtateClient`` with blocking methods. Build it with ``SyncZtateClient.from_files``
    or ``from_env`` (the same arguments as the asynchronous client)."""

    def __init__(self, connect: Callable[[], ZtateClient]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ztate-sync-client", daemon=True
        )
        self._thread.start()

        async def build() -> ZtateClient:
            return connect()  # the channel must be created on the client's loop

        self._client = self._run(build())

    @classmethod
    def from_files(cls, target: str, **kwargs: Any) -> SyncZtateClient:
        """Connect as ``ZtateClient.from_files`` does."""
        return cls(lambda: ZtateClient.from_files(target, **kwargs))

    @classmethod
    def from_env(cls, prefix: str = "ZTATE_WORKER_") -> SyncZtateClient:
        """Connect as ``ZtateClient.from_env`` does."""
        return cls(lambda: ZtateClient.from_env(prefix))

    def _run(self, call: Coroutine[Any, Any, Result]) -> Result:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def create_thread(
        self, thread_id: str, initial_state: dict[str, Any], *, policy: str = ""
    ) -> Transition:
        """See ``ZtateClient.create_thread``."""
        return self._run(self._client.create_thread(thread_id, initial_state, policy=policy))

    def get_view(self, thread_id: str) -> View:
        """See ``ZtateClient.get_view``."""
        return self._run(self._client.get_view(thread_id))

    def propose(
        self,
        thread_id: str,
        expected_version: int,
        patch: dict[str, Any] | bytes,
        *,
        idempotency_key: str | None = None,
        lease_epoch: int = 0,
    ) -> Transition:
        """See ``ZtateClient.propose``."""
        return self._run(
            self._client.propose(
                thread_id,
                expected_version,
                patch,
                idempotency_key=idempotency_key,
                lease_epoch=lease_epoch,
            )
        )

    def renew_lease(self, thread_id: str, lease_epoch: int) -> datetime:
        """See ``ZtateClient.renew_lease``."""
        return self._run(self._client.renew_lease(thread_id, lease_epoch))

    def release_lease(self, thread_id: str, lease_epoch: int, handled_version: int) -> None:
        """See ``ZtateClient.release_lease``."""
        self._run(self._client.release_lease(thread_id, lease_epoch, handled_version))

    def serve(
        self,
        handler: Callable[[View], dict[str, Any] | None],
        *,
        stop: threading.Event | None = None,
        **options: Unpack[ServeOptions],
    ) -> list[Step]:
        """Serve all of this node's work (``NodeRunner.serve``) until ``stop`` is set:
        ``handler`` runs on worker threads, ``concurrency`` at a time, each on the
        node's projection of a thread it holds the lease of; it returns a patch or
        None. ``options`` are those of ``NodeRunner.for_node`` (``ServeOptions``:
        ``node_name``, ``concurrency``, ``shutdown_grace``, ``approval_wait``,
        ``max_outcome_waits``, ``attempts``, ``on_step``, ``on_parked``), with the same
        defaults; ``on_step`` and ``on_parked`` are called on the client's event-loop
        thread. On stop, running handlers get ``shutdown_grace`` seconds and the
        leases of the others are released."""
        stop = stop or threading.Event()

        async def serving() -> list[Step]:
            stopped = asyncio.Event()
            loop = asyncio.get_running_loop()
            waiter = threading.Thread(
                target=lambda: (stop.wait(), loop.call_soon_threadsafe(stopped.set)),
                name="ztate-sync-serve-stop",
                daemon=True,
            )
            waiter.start()

            async def in_thread(view: View) -> dict[str, Any] | None:
                return await asyncio.to_thread(handler, view)

            runner = NodeRunner.for_node(self._client, in_thread, **options)
            return await runner.serve(stopped)

        return self._run(serving())

    def subscribe_work(self, *, max_in_flight: int = 1) -> Iterator[WorkItem]:
        """See ``ZtateClient.subscribe_work``: a blocking iterator."""
        stream = self._client.subscribe_work(max_in_flight=max_in_flight)

        async def step() -> WorkItem:
            return await anext(stream)

        try:
            while True:
                try:
                    yield self._run(step())
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())

    def update(
        self, thread_id: str, change: Callable[[View], dict[str, Any]], *, attempts: int = 5
    ) -> Transition:
        """See ``ZtateClient.update``."""
        return self._run(self._client.update(thread_id, change, attempts=attempts))

    def wait_for_outcome(self, parked: AwaitingApproval | str, *, within: float = 60.0) -> Outcome:
        """See ``ZtateClient.wait_for_outcome``."""
        return self._run(self._client.wait_for_outcome(parked, within=within))

    def get_record(self, thread_id: str, *, version: int | None = None) -> HeadRecord:
        """See ``ZtateClient.get_record``."""
        return self._run(self._client.get_record(thread_id, version=version))

    def get_checkpoint(self, thread_id: str) -> Checkpoint | None:
        """See ``ZtateClient.get_checkpoint``."""
        return self._run(self._client.get_checkpoint(thread_id))

    def watch(self, thread_id: str, from_version: int = -1) -> Iterator[WatchEvent]:
        """See ``ZtateClient.watch``: a blocking iterator; close it (or leave the loop)
        to end the stream."""
        stream = self._client.watch(thread_id, from_version)

        async def step() -> WatchEvent:
            return await anext(stream)

        try:
            while True:
                try:
                    yield self._run(step())
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())

    def close(self) -> None:
        """Close the channel and stop the background loop."""
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SyncZtateClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
