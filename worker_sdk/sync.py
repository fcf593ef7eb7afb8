"""A blocking client for workers that are not written with asyncio.

It runs a private event loop on a background thread and forwards each call to
the asynchronous ``ZtateClient``; every method blocks until that call is done
and raises the same typed errors.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from worker_sdk.client import Outcome, Transition, View, ZtateClient

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
        return cls(lambda: ZtateClient.from_files(target, **kwargs))

    @classmethod
    def from_env(cls, prefix: str = "ZTATE_WORKER_") -> SyncZtateClient:
        return cls(lambda: ZtateClient.from_env(prefix))

    def _run(self, call: Coroutine[Any, Any, Result]) -> Result:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def create_thread(
        self, thread_id: str, initial_state: dict[str, Any], *, policy: str = ""
    ) -> Transition:
        return self._run(self._client.create_thread(thread_id, initial_state, policy=policy))

    def get_view(self, thread_id: str) -> View:
        return self._run(self._client.get_view(thread_id))

    def propose(
        self,
        thread_id: str,
        expected_version: int,
        patch: dict[str, Any] | bytes,
        *,
        idempotency_key: str | None = None,
    ) -> Transition:
        return self._run(
            self._client.propose(
                thread_id, expected_version, patch, idempotency_key=idempotency_key
            )
        )

    def update(
        self, thread_id: str, change: Callable[[View], dict[str, Any]], *, attempts: int = 5
    ) -> Transition:
        return self._run(self._client.update(thread_id, change, attempts=attempts))

    def wait_for_outcome(self, digest: str, *, within: float = 60.0) -> Outcome:
        return self._run(self._client.wait_for_outcome(digest, within=within))

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
