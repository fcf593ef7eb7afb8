"""The checkpoint signer's own memory, outside the database it signs.

A signer that trusted the database would sign whatever head row it found there:
an administrator who rewrites a thread and deletes its checkpoint rows would get a
valid signature over the forgery. So every checkpoint this service signs is also
appended to a file of its own (``ZTATE_CHECKPOINT_JOURNAL_FILE``), one line per
checkpoint in the format of a bundle's ``checkpoints.jsonl``
(``ztate.contract.checkpoints.checkpoint_line``). The signer reads it back to know
the last head it signed of each thread, and refuses to sign a head that does not
extend it; auditors give the same file to ``ztate verify --checkpoints``.

Replicas may share one file (appends of whole lines) or keep one each: each
replica reads the lines others appended since its last read before every round.

Beside the journal, ``NotePublisher`` keeps each thread's latest checkpoint as a C2SP
signed note (``notes/thread-<id>.note``), the envelope transparency-log tooling reads
(docs/verification.md, "Checkpoints as signed notes").
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.checkpoints import (
    SignedCheckpoint,
    checkpoint_line,
    note_text,
    parse_checkpoint_line,
    sign_note,
)
from ztate.contract.errors import CheckpointInvalid
from ztate.contract.record import HEX_256
from ztate.services.runtime.thread_ids import THREAD_ID


class JournalError(Exception):
    """The journal cannot be read or written; the signer stops signing until it can."""


@dataclass(frozen=True, slots=True)
class SignedHead:
    """The last head of a thread this journal holds a checkpoint of."""

    version: int
    head_digest: str


class CheckpointJournal:
    """Append-only lines of signed checkpoints, and the last signed head per thread."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._heads: dict[str, SignedHead] = {}

    @property
    def path(self) -> Path:
        return self._path

    def last_signed(self, thread_id: str) -> SignedHead | None:
        return self._heads.get(thread_id)

    def refresh(self) -> None:
        """Read the lines appended since the last read (by this replica or another).

        A line that is not a checkpoint line stops the signer (``JournalError``): its
        memory would be incomplete. A cut last line (a crash mid-write) is left for
        the next read."""
        try:
            with self._path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise JournalError(f"{self._path}: cannot read ({exc.strerror})") from None
        complete = data[: data.rfind(b"\n") + 1]
        for number, line in enumerate(complete.splitlines(), start=1):
            try:
                thread_id, version, signed = parse_checkpoint_line(line)
                head_digest = _signed_head(signed, thread_id, version)
            except CheckpointInvalid as exc:
                raise JournalError(
                    f"{self._path}: line {number} after byte {self._offset} is not a "
                    f"checkpoint line ({exc.message})"
                ) from None
            known = self._heads.get(thread_id)
            if known is None or version >= known.version:
                self._heads[thread_id] = SignedHead(version, head_digest)
        self._offset += len(complete)

    def append(self, signed: list[tuple[str, int, SignedCheckpoint]]) -> None:
        """Append checkpoints and make them durable before they are stored anywhere
        else: what the database holds, the journal holds first."""
        if not signed:
            return
        data = b"".join(checkpoint_line(t, v, c) for t, v, c in signed)
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise JournalError(f"{self._path}: cannot append ({exc.strerror})") from None
        self.refresh()


def _signed_head(signed: SignedCheckpoint, thread_id: str, version: int) -> str:
    """The head digest a journal line's checkpoint signs, once its signed content
    names the line's thread and version."""
    try:
        body = json.loads(signed.checkpoint)
    except (ValueError, RecursionError):
        raise CheckpointInvalid("the checkpoint is not JSON") from None
    if not isinstance(body, dict) or (body.get("thread_id"), body.get("version")) != (
        thread_id,
        version,
    ):
        raise CheckpointInvalid("the checkpoint signs another thread or version than its line")
    digest = body.get("head_digest")
    if not isinstance(digest, str) or not HEX_256.match(digest):
        raise CheckpointInvalid("head_digest must be 64 lower-case hex characters")
    return digest


class NotePublisher:
    """Each thread's latest signed checkpoint as a C2SP signed note, one file per thread
    (``thread-<id>.note`` in ``folder``, replaced atomically), signed by the checkpoint
    key under the note name ``authority`` (the trust domain): what a tlog-checkpoint
    server publishes at its checkpoint URL, for each thread's chain."""

    def __init__(self, folder: Path, authority: str) -> None:
        self._folder = folder
        self._authority = authority

    @property
    def folder(self) -> Path:
        return self._folder

    def publish(self, signed: list[SignedCheckpoint], key: Ed25519PrivateKey) -> None:
        latest: dict[str, tuple[int, bytes]] = {}
        for checkpoint in signed:
            body = json.loads(checkpoint.checkpoint)  # signed just now, by this process
            thread_id, version = body["thread_id"], body["version"]
            if not THREAD_ID.fullmatch(thread_id):  # a head row from the database: it names
                continue  # the file, so a forged id ("../x") must never reach a path
            if thread_id not in latest or version > latest[thread_id][0]:
                text = note_text(body, self._authority)
                latest[thread_id] = (version, sign_note(text, self._authority, key))
        try:
            self._folder.mkdir(parents=True, exist_ok=True)
            for thread_id, (_version, note) in latest.items():
                # a temporary file of this writer's own: replicas sharing the folder
                # never write into each other's
                fd, partial = tempfile.mkstemp(
                    dir=self._folder, prefix=f".thread-{thread_id}.", suffix=".partial"
                )
                try:
                    with os.fdopen(fd, "wb") as handle:
                        handle.write(note)
                    os.chmod(partial, 0o644)
                    os.replace(partial, self._folder / f"thread-{thread_id}.note")
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(partial)
                    raise
        except OSError as exc:
            raise JournalError(f"{self._folder}: cannot publish notes ({exc.strerror})") from None
