"""Signing checkpoints of thread heads that moved since their last checkpoint.

Runs in every replica; two replicas signing the same head is harmless (one row
per thread and version). A head signed once stays signed: checkpoints are
append-only.

The signer never takes the database's word for a head (docs/threat-model.md,
"the database administrator"). Before it signs, it checks that the head extends
the last head it signed of that thread, as its own journal
(``ztate.transition_service.journal``) remembers it: every record from that head
to the new one hashes to its digest, carries a valid HMAC under the service's
keyring, and links to the one before. A head that does not extend it (a rewritten
history, a rolled-back head, a record signed without the key) is refused, loudly:
an ERROR log line and the ``ztate.checkpoint.refusals`` counter, every round until
an operator looks. A thread this signer never signed is checked from genesis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from opentelemetry import metrics

from ztate.contract.checkpoints import SignedCheckpoint, sign_checkpoint
from ztate.contract.errors import RecordInvalid
from ztate.contract.keyring import Keyring
from ztate.contract.record import GENESIS_PARENT, verify_record
from ztate.services.runtime.telemetry import untraced
from ztate.services.store.interface import TransitionStore, UnsignedHead
from ztate.transition_service.journal import (
    CheckpointJournal,
    JournalError,
    NotePublisher,
    SignedHead,
)

log = logging.getLogger("ztate.transition")
BATCH = 1000
PAGE = 1000  # records read at a time while checking that a head extends the last signed

REFUSALS = metrics.get_meter("ztate.transition").create_counter(
    "ztate.checkpoint.refusals",
    unit="{head}",
    description="heads the checkpoint signer refused: they do not extend its last signed head",
)


class NotExtending(Exception):
    """The head does not extend the last head this signer signed; the message says
    where the chain breaks (versions and digests, never a state value)."""


class Checkpointer:
    """Signs unsigned heads now (``run_once``) or every ``interval`` seconds."""

    def __init__(
        self,
        store: TransitionStore,
        key: Ed25519PrivateKey,
        key_id: str,
        interval: float,
        *,
        keyring: Keyring,
        journal: CheckpointJournal,
        notes: NotePublisher | None = None,
    ) -> None:
        """``notes``: also publish each thread's latest checkpoint as a C2SP signed note."""
        self._store = store
        self._notes = notes
        self._key = key
        self._key_id = key_id
        self._interval = interval
        self._keyring = keyring
        self._journal = journal
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
        """Sign every head that has no checkpoint yet and extends the last head this
        signer signed of its thread; returns how many were signed. Heads are taken a
        page at a time, so that refused heads (which stay unsigned) never crowd out
        the others."""
        self._journal.refresh()
        count, after = 0, ""
        while heads := await self._store.unsigned_heads(BATCH, after):
            count += await self._sign(heads)
            after = heads[-1].thread_id
        return count

    async def _sign(self, heads: list[UnsignedHead]) -> int:
        now = datetime.now(UTC)
        signed: list[tuple[UnsignedHead, SignedCheckpoint, datetime]] = []
        for head in heads:
            try:
                await self._check_extends(head, self._journal.last_signed(head.thread_id))
            except NotExtending as refused:
                REFUSALS.add(1)
                log.error(
                    "checkpoint signer REFUSED thread %s at version %d: %s; the ledger may "
                    "have been rewritten in the database (see docs/operations.md, "
                    "'A refused checkpoint')",
                    head.thread_id,
                    head.version,
                    refused,
                )
                continue
            checkpoint = sign_checkpoint(
                self._key,
                self._key_id,
                thread_id=head.thread_id,
                version=head.version,
                head_digest=head.head_digest,
                signed_at=now,
            )
            signed.append((head, checkpoint, now))
        # the journal first: what the database holds, the signer's memory holds too
        self._journal.append([(h.thread_id, h.version, c) for h, c, _ in signed])
        await self._store.save_checkpoints(signed)
        if self._notes is not None:  # a copy for transparency-log tooling, written last
            try:
                self._notes.publish([c for _, c, _ in signed], self._key)
            except JournalError as failure:
                # the checkpoints are journalled and stored: the round and its next
                # pages go on, and each thread's note is replaced at its next signed head
                log.warning("publishing checkpoint notes failed: %s", failure)
        return len(signed)

    async def _check_extends(self, head: UnsignedHead, last: SignedHead | None) -> None:
        """Raise ``NotExtending`` unless the records from ``last`` (genesis when None)
        to ``head`` verify and link, each under the keyring, ending at ``head``."""
        if last is not None and (
            head.version < last.version
            or (head.version == last.version and head.head_digest != last.head_digest)
        ):
            raise NotExtending(
                f"the head is version {head.version} digest {head.head_digest}; this signer "
                f"signed version {last.version} digest {last.head_digest}"
            )
        # from the last signed record itself, whose digest must still be what was signed
        after = -1 if last is None else last.version - 1
        parent: str | None = GENESIS_PARENT if last is None else None
        expected = after + 1
        while expected <= head.version:
            page = await self._store.records_after(head.thread_id, expected - 1, PAGE)
            if not page:
                raise NotExtending(f"no record at version {expected} on the way to the head")
            for row in page:
                if row.version > head.version:
                    break
                if row.version != expected:
                    raise NotExtending(f"version {expected} is missing; found {row.version}")
                if (
                    last is not None
                    and row.version == last.version
                    and row.digest != last.head_digest
                ):
                    raise NotExtending(
                        f"the record at the signed version {last.version} is now "
                        f"{row.digest}, not the signed {last.head_digest}"
                    )
                try:
                    record = verify_record(
                        row.record,
                        digest=row.digest,
                        signature=row.signature,
                        keyring=self._keyring,
                        expected_parent=parent,
                        expected_version=row.version,
                    )
                except RecordInvalid as broken:
                    raise NotExtending(f"version {row.version}: {broken.message}") from None
                if record["thread_id"] != head.thread_id:
                    raise NotExtending(f"version {row.version} is a record of another thread")
                parent, expected = row.digest, expected + 1
        if parent != head.head_digest:
            raise NotExtending(
                f"the records end at digest {parent}, not at the head's {head.head_digest}"
            )
