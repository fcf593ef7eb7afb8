"""Signing checkpoints of thread heads that moved since their last checkpoint.

Runs in every replica; two replicas signing the same head is harmless (one row
per thread and version). A head signed once stays signed: checkpoints are
append-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.checkpoints import sign_checkpoint
from ztate.services.runtime.telemetry import untraced
from ztate.services.store.interface import TransitionStore

log = logging.getLogger("ztate.transition")
BATCH = 1000


class Checkpointer:
    """Signs unsigned heads now (``run_once``) or every ``interval`` seconds."""

    def __init__(
        self, store: TransitionStore, key: Ed25519PrivateKey, key_id: str, interval: float
    ) -> None:
        self._store = store
        self._key = key
        self._key_id = key_id
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ztate-checkpointer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                with untraced():  # background work: no root trace each round
                    await self.run_once()
            except Exception as failure:  # checkpointing must outlive any one failure
                log.warning("checkpointing failed: %s; next round retries", type(failure).__name__)

    async def run_once(self) -> int:
        """Sign every head that has no checkpoint yet (up to a batch); returns how many."""
        heads = await self._store.unsigned_heads(BATCH)
        now = datetime.now(UTC)
        signed = [
            (
                head,
                sign_checkpoint(
                    self._key,
                    self._key_id,
                    thread_id=head.thread_id,
                    version=head.version,
                    head_digest=head.head_digest,
                    signed_at=now,
                ),
                now,
            )
            for head in heads
        ]
        await self._store.save_checkpoints(signed)
        return len(signed)
