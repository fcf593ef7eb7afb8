"""Ledger bundles: an export an auditor verifies with no database and no server.

A bundle is a folder of three files. ``records.jsonl`` holds one JSON object per
ledger row, in ``(thread_id, version)`` order, with the record as its exact
canonical text, so the bytes that were hashed and signed travel unchanged.
``checkpoints.jsonl`` holds the signed checkpoints (format 2 bundles; format 1
bundles have none), in the same order, so that ``ztate verify --bundle
--public-only`` can anchor the chain with public keys alone.
``manifest.json`` is a packing list: counts, the files' SHA-256 and every
thread's head as the database held it at export time. The manifest is not
signed (the records carry their own proof: digests, HMACs, the chain and the
receipts); it turns a truncated, padded or edited file into a precise finding
instead of a silently shorter ledger, and its heads catch records removed from
the end of a thread, which no chain can show by itself.

``export_bundle`` writes one from Postgres in a single consistent snapshot;
``verify_bundle`` streams it through the same checks as ``ztate verify`` against
a database (``ztate.services.verify.checks``), holding one thread's previous record at a time.

Each line has exactly these members::

    thread_id, version, digest, parent_digest, node_id, key_id, signature,
    record             the canonical record text
    state, receipt     text, or null when the row keeps none
    receipt_signature, receipt_key_id, committed_at

and each checkpoint line ``thread_id, version, checkpoint`` (the signed canonical
text), ``signature, key_id``. Both files are sorted by thread id in code point
order (Postgres ``COLLATE "C"``), so the verifier merges them in one pass.

A byte string that is not UTF-8 (only a damaged row holds one) is written as
``{"base64": "..."}`` instead of text, so that an export never loses evidence.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import operator
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import asyncpg
import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.checkpoints import (
    SignedCheckpoint,
    checkpoint_line,
    parse_checkpoint_line,
    sign_manifest,
    verify_manifest_signature,
)
from ztate.contract.errors import CheckpointInvalid
from ztate.contract.files import FileTooLarge, read_bounded
from ztate.contract.record import format_time, shown
from ztate.services.store.policies import StoredPolicy, stored_policy_versions
from ztate.services.verify.checks import (
    BUNDLE_CHECKPOINT,
    BUNDLE_COUNT,
    BUNDLE_HASH,
    BUNDLE_LINE,
    BUNDLE_MANIFEST,
    BUNDLE_ORDER,
    CHECKPOINT,
    MAX_POLICY_BODY,
    Finding,
    Head,
    LedgerRow,
    Report,
    Summary,
    ThreadVerifier,
    Trust,
    Verification,
    VerifyError,
    admit_policy_versions,
    check_policies_named,
    collector_frozen,
    connect,
    no_such_thread,
    row_from_db,
)

BUNDLE_FORMAT = 3  # 2: with checkpoints.jsonl; 3: with policies.jsonl
READABLE_FORMATS = (1, 2, 3)
BUNDLE_KIND = "ztate-ledger-bundle"
RECORDS = "records.jsonl"
CHECKPOINTS = "checkpoints.jsonl"
POLICIES = "policies.jsonl"
MANIFEST = "manifest.json"
MANIFEST_SIG = "manifest.sig"  # the checkpoint key's signature over the manifest's SHA-256
# manifest.sig is one line of about 400 bytes; a longer file is read no further
MAX_MANIFEST_SIG = 64 * 1024
# manifest.json grows by about 100 bytes a thread (its head): 1 GiB is ten million
# threads; a larger one is refused, read no further
MAX_MANIFEST = 1024 * 1024 * 1024
POLICY_MEMBERS = ("policy_digest", "policy_name", "body")
# a policies.jsonl line longer than this holds no body the verifier reads (escaping may
# double a body's length; checks.MAX_POLICY_BODY bounds the body itself)
MAX_POLICY_LINE = 4 * MAX_POLICY_BODY
# a bundle holds full state bodies: only its owner may read it
FILE_MODE, DIR_MODE = 0o600, 0o700


HEX_256 = re.compile(r"^[0-9a-f]{64}\Z")
LINE_MEMBERS = (
    "thread_id",
    "version",
    "digest",
    "parent_digest",
    "node_id",
    "key_id",
    "signature",
    "record",
    "state",
    "receipt",
    "receipt_signature",
    "receipt_key_id",
    "committed_at",
)
_LINE_MEMBER_SET = frozenset(LINE_MEMBERS)
_TEXT_MEMBERS = ("thread_id", "digest", "parent_digest", "node_id", "key_id", "signature")
_OPTIONAL_TEXT = ("receipt_signature", "receipt_key_id", "committed_at")
_TEXT = operator.itemgetter(*_TEXT_MEMBERS)
_OPTIONAL = operator.itemgetter(*_OPTIONAL_TEXT)
_STR, _STR_OR_NULL = frozenset({str}), frozenset({str, type(None)})


class BundleError(VerifyError):
    """The bundle cannot be read or written at all (exit code 2)."""


class NothingToExport(BundleError):
    """``--thread`` names a thread the ledger never had: no bundle is written (an empty
    one would verify "OK" and hide the typo)."""


class Tally:
    """The lines of one bundle file as written or read: how many, and their SHA-256,
    which is what the manifest's packing list says of the file. The one count of bundle
    lines: the writer fills the manifest from it, and the readers number their findings
    with it and compare it with the manifest. A file is taken in either by lines
    (``line``, ``rest``) or by blocks of bytes as read (``block``), never both."""

    __slots__ = ("_hasher", "_newlines", "_open", "lines")

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()
        self.lines = 0
        self._newlines = 0
        self._open = False  # the last block ended inside a line

    def line(self, line: bytes) -> int:
        """Count and hash a line (or its first part, for a line read in parts); its
        number in the file."""
        self._hasher.update(line)
        self.lines += 1
        return self.lines

    def rest(self, part: bytes) -> None:
        """Hash more of the line last counted."""
        self._hasher.update(part)

    def hashed(self, data: bytes) -> None:
        """Hash the next bytes of a file whose lines a ``LineReader`` counts (then
        ``lines_cut``)."""
        self._hasher.update(data)

    def lines_cut(self, lines: int) -> None:
        """The count of the lines of a file taken in by ``hashed``, once all read."""
        self.lines = lines

    def block(self, data: bytes) -> None:
        """Count and hash the next bytes of the file, whatever lines they cut: a last
        line without its newline counts, as reading by lines counts it."""
        if data:
            self._hasher.update(data)
            self._newlines += data.count(b"\n")
            self._open = not data.endswith(b"\n")
            self.lines = self._newlines + self._open

    @property
    def sha256(self) -> str:
        return self._hasher.hexdigest()


@dataclass(frozen=True, slots=True)
class Manifest:
    created_at: str
    thread_id: str | None  # the one thread exported, or None for all
    threads: int
    records: int
    records_sha256: str
    policy_digests: tuple[str, ...]
    heads: dict[str, tuple[int, str]]
    # None: a format 1 bundle, which carries no checkpoints
    checkpoints: int | None = None
    checkpoints_sha256: str | None = None
    # None: a bundle before format 3, which carries no policy versions
    policies: int | None = None
    policies_sha256: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "format": BUNDLE_FORMAT,
            "kind": BUNDLE_KIND,
            "created_at": self.created_at,
            "thread_id": self.thread_id,
            "threads": self.threads,
            "records": self.records,
            "records_sha256": self.records_sha256,
            "policy_digests": list(self.policy_digests),
            "heads": {thread: [v, d] for thread, (v, d) in self.heads.items()},
            "checkpoints": self.checkpoints,
            "checkpoints_sha256": self.checkpoints_sha256,
            "policies": self.policies,
            "policies_sha256": self.policies_sha256,
        }


# --- export -----------------------------------------------------------------------------

# Each column cast to the schema's type, as the verifier reads them (checks.ROWS): a
# column whose type was altered is exported as the type the bundle format holds, or
# the export fails ("reading the ledger failed"); a cast to the own type is no cast.
EXPORT_ROWS = """
SELECT thread_id::text AS thread_id, version::bigint AS version, digest::text AS digest,
       parent_digest::text AS parent_digest, node_id::text AS node_id,
       key_id::text AS key_id, signature::text AS signature, record::bytea AS record,
       state::bytea AS state, receipt::bytea AS receipt,
       receipt_signature::text AS receipt_signature, receipt_key_id::text AS receipt_key_id,
       committed_at::timestamptz AS committed_at
  FROM ztate.transitions
"""
EXPORT_HEADS = (
    "SELECT thread_id::text AS thread_id, version::bigint AS version, "
    "head_digest::text AS head_digest FROM ztate.threads"
)
EXPORT_CHECKPOINTS = """
SELECT thread_id::text AS thread_id, version::bigint AS version,
       checkpoint::bytea AS checkpoint, signature::text AS signature, key_id::text AS key_id
  FROM ztate.checkpoints
"""
# code point order, which Python's string comparison shares: the verifier merges
# the records with the checkpoints in one pass
ORDER = ' ORDER BY thread_id COLLATE "C", version'


Signer = tuple[str, Ed25519PrivateKey]  # (key id, the checkpoint signing key)


async def export_bundle(
    dsn: str, out_dir: Path, thread_id: str | None = None, *, signer: Signer | None = None
) -> Manifest:
    """Write every thread (or one) of the ledger at ``dsn`` as a bundle in ``out_dir``,
    its manifest signed with ``signer`` (the checkpoint key) when given."""
    conn = await connect(dsn)
    try:
        async with conn.transaction(readonly=True, isolation="repeatable_read"):
            manifest = await _export_snapshot(conn, out_dir, thread_id, signer)
    except asyncpg.UndefinedTableError:
        raise BundleError("the database holds no ztate ledger (schema ztate is missing)") from None
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise BundleError(f"reading the ledger failed: {type(exc).__name__}: {exc}") from None
    finally:
        await conn.close()
    return manifest


async def _export_snapshot(
    conn: asyncpg.Connection, out_dir: Path, thread_id: str | None, signer: Signer | None
) -> Manifest:
    where, args = ("", ()) if thread_id is None else (" WHERE thread_id = $1", (thread_id,))
    heads = {
        head["thread_id"]: (head["version"], head["head_digest"])
        for head in await conn.fetch(EXPORT_HEADS + where, *args)
    }
    if thread_id is not None and not heads:
        raise NothingToExport(f"the ledger has no thread {shown(thread_id)}: nothing exported")
    with BundleWriter(out_dir) as writer:
        async for stored in conn.cursor(EXPORT_ROWS + where + ORDER, *args, prefetch=256):
            writer.add(row_from_db(stored))
        async for stored in conn.cursor(EXPORT_CHECKPOINTS + where + ORDER, *args, prefetch=256):
            writer.add_checkpoint(
                stored["thread_id"],
                stored["version"],
                SignedCheckpoint(
                    bytes(stored["checkpoint"]), stored["signature"], stored["key_id"]
                ),
            )
        for version in await stored_policy_versions(conn, writer.policy_digests):
            writer.add_policy(version)
        return writer.finish(heads, thread_id=thread_id, signer=signer)


class BundleWriter:
    """Writes ``records.jsonl`` row by row and ``checkpoints.jsonl`` checkpoint by
    checkpoint, then the manifest that describes them.

    The manifest is written last: a folder without one is an export that did not
    finish. The folder must not hold a bundle already.
    """

    def __init__(self, out_dir: Path) -> None:
        self._records_path, self._manifest_path = out_dir / RECORDS, out_dir / MANIFEST
        self._checkpoints_path = out_dir / CHECKPOINTS
        self._policies_path = out_dir / POLICIES
        try:
            if not out_dir.exists():
                out_dir.mkdir(parents=True, mode=DIR_MODE)
            if self._manifest_path.exists():
                raise FileExistsError
            self._out = _owner_only(self._records_path)
            self._checkpoints_out = _owner_only(self._checkpoints_path)
            self._policies_out = _owner_only(self._policies_path)
        except FileExistsError:
            raise BundleError(
                f"{out_dir}: already holds a bundle; choose an empty folder"
            ) from None
        except OSError as exc:
            raise BundleError(f"{out_dir}: cannot write a bundle ({exc.strerror})") from None
        self._records, self._checkpoints, self._policies = Tally(), Tally(), Tally()
        self._threads = 0
        self._last_thread: str | None = None
        self._policy_digests: set[str] = set()

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self._out.close()
        self._checkpoints_out.close()
        self._policies_out.close()

    @property
    def policy_digests(self) -> list[str]:
        """The policy digests the records written so far name, sorted."""
        return sorted(self._policy_digests)

    def add_policy(self, version: StoredPolicy) -> None:
        """One policy version (in digest order): its exact body, as the database keeps it."""
        line = policy_line(version)
        try:
            self._policies_out.write(line)
        except OSError as exc:
            raise BundleError(f"{self._policies_path}: cannot write ({exc.strerror})") from None
        self._policies.line(line)

    def add(self, row: LedgerRow) -> None:
        line = orjson.dumps(_line(row)) + b"\n"
        try:
            self._out.write(line)
        except OSError as exc:
            raise BundleError(f"{self._records_path}: cannot write ({exc.strerror})") from None
        self._records.line(line)
        if row.thread_id != self._last_thread:
            self._threads, self._last_thread = self._threads + 1, row.thread_id
        digest = _policy_digest(row.record)
        if digest is not None:
            self._policy_digests.add(digest)

    def add_checkpoint(self, thread_id: str, version: int, signed: SignedCheckpoint) -> None:
        line = checkpoint_line(thread_id, version, signed)
        try:
            self._checkpoints_out.write(line)
        except OSError as exc:
            raise BundleError(f"{self._checkpoints_path}: cannot write ({exc.strerror})") from None
        self._checkpoints.line(line)

    def finish(
        self,
        heads: dict[str, tuple[int, str]],
        *,
        thread_id: str | None = None,
        created_at: datetime | None = None,
        signer: Signer | None = None,
    ) -> Manifest:
        """Close the files and write the manifest, with the heads the source holds
        (``created_at``: now, unless a generator of fixed bundles gives it), and its
        signature (``manifest.sig``) when ``signer`` is given."""
        self._out.close()
        self._checkpoints_out.close()
        self._policies_out.close()
        manifest = Manifest(
            created_at=format_time(created_at := created_at or datetime.now(UTC)),
            thread_id=thread_id,
            threads=self._threads,
            records=self._records.lines,
            records_sha256=self._records.sha256,
            policy_digests=tuple(sorted(self._policy_digests)),
            heads=heads,
            checkpoints=self._checkpoints.lines,
            checkpoints_sha256=self._checkpoints.sha256,
            policies=self._policies.lines,
            policies_sha256=self._policies.sha256,
        )
        data = orjson.dumps(manifest.as_json(), option=orjson.OPT_INDENT_2)
        try:
            with _owner_only(self._manifest_path) as out:
                out.write(data)
            if signer is not None:
                key_id, key = signer
                line = sign_manifest(
                    key,
                    key_id,
                    manifest_sha256=hashlib.sha256(data).hexdigest(),
                    signed_at=created_at,
                )
                with _owner_only(self._manifest_path.with_name(MANIFEST_SIG)) as out:
                    out.write(line)
        except OSError as exc:
            raise BundleError(f"{self._manifest_path}: cannot write ({exc.strerror})") from None
        return manifest


def _owner_only(path: Path) -> BinaryIO:
    """A new file only its owner may read or write (``FileExistsError`` if it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # whatever the umask
    return os.fdopen(fd, "wb")


def policy_line(version: StoredPolicy) -> bytes:
    """One line of ``policies.jsonl``: digest, name and the exact body (text, or
    ``{"base64": ...}`` for bytes that are not UTF-8)."""
    return (
        orjson.dumps(
            {
                "policy_digest": version.digest,
                "policy_name": version.name,
                "body": _blob_out(version.body),
            }
        )
        + b"\n"
    )


def _line(row: LedgerRow) -> dict[str, Any]:
    return {
        "thread_id": row.thread_id,
        "version": row.version,
        "digest": row.digest,
        "parent_digest": row.parent_digest,
        "node_id": row.node_id,
        "key_id": row.key_id,
        "signature": row.signature,
        "record": _blob_out(row.record),
        "state": _blob_out(row.state),
        "receipt": _blob_out(row.receipt),
        "receipt_signature": row.receipt_signature,
        "receipt_key_id": row.receipt_key_id,
        "committed_at": row.committed_at,
    }


def _blob_out(data: bytes | None) -> str | dict[str, str] | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def _policy_digest(record: bytes) -> str | None:
    try:
        parsed = orjson.loads(record)
    except orjson.JSONDecodeError:
        return None
    digest = parsed.get("policy_digest") if isinstance(parsed, dict) else None
    return digest if isinstance(digest, str) else None


# --- reading ----------------------------------------------------------------------------


def read_manifest(directory: Path) -> tuple[Manifest, str]:
    """The manifest of the bundle in ``directory`` and the SHA-256 of the bytes it was
    read from (read once: the signature is checked over the bytes verified, never over a
    second read another file system could answer differently); ``BundleError`` if
    unusable."""
    path = directory / MANIFEST
    try:
        raw = read_bounded(path, MAX_MANIFEST, "a manifest")
        doc = orjson.loads(raw)
    except OSError as exc:
        raise BundleError(f"{path}: cannot read the manifest ({exc.strerror})") from None
    except FileTooLarge as exc:
        raise BundleError(str(exc)) from None
    except orjson.JSONDecodeError:
        raise BundleError(f"{path}: the manifest is not JSON") from None
    if (
        not isinstance(doc, dict)
        or doc.get("kind") != BUNDLE_KIND
        or doc.get("format") not in READABLE_FORMATS
        or type(doc.get("format")) is not int
    ):
        formats = " or ".join(str(f) for f in READABLE_FORMATS)
        raise BundleError(f"{path}: not a format {formats} {BUNDLE_KIND} manifest")
    try:
        return _manifest_from(doc), hashlib.sha256(raw).hexdigest()
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{path}: malformed manifest ({exc})") from None


def _manifest_from(doc: dict[str, Any]) -> Manifest:
    heads: dict[str, tuple[int, str]] = {}
    for thread, head in doc["heads"].items():
        version, digest = head
        if type(version) is not int or not isinstance(digest, str):
            raise ValueError(f"head of {thread!r} must be [version, digest]")
        heads[thread] = (version, digest)
    counts = (doc["threads"], doc["records"])
    if any(type(count) is not int for count in counts):
        raise ValueError("threads and records must be integers")
    if not isinstance(doc["records_sha256"], str) or not HEX_256.match(doc["records_sha256"]):
        raise ValueError("records_sha256 must be 64 lower-case hex characters")
    thread_id = doc.get("thread_id")
    checkpoints, checkpoints_sha256 = None, None
    if doc["format"] >= 2:
        checkpoints, checkpoints_sha256 = doc["checkpoints"], doc["checkpoints_sha256"]
        if type(checkpoints) is not int:
            raise ValueError("checkpoints must be an integer")
        if not isinstance(checkpoints_sha256, str) or not HEX_256.match(checkpoints_sha256):
            raise ValueError("checkpoints_sha256 must be 64 lower-case hex characters")
    policies, policies_sha256 = None, None
    if doc["format"] >= 3:
        policies, policies_sha256 = doc["policies"], doc["policies_sha256"]
        if type(policies) is not int:
            raise ValueError("policies must be an integer")
        if not isinstance(policies_sha256, str) or not HEX_256.match(policies_sha256):
            raise ValueError("policies_sha256 must be 64 lower-case hex characters")
    return Manifest(
        created_at=str(doc["created_at"]),
        thread_id=thread_id if isinstance(thread_id, str) else None,
        threads=doc["threads"],
        records=doc["records"],
        records_sha256=doc["records_sha256"],
        policy_digests=tuple(str(d) for d in doc["policy_digests"]),
        heads=heads,
        checkpoints=checkpoints,
        checkpoints_sha256=checkpoints_sha256,
        policies=policies,
        policies_sha256=policies_sha256,
    )


class LineProblem(ValueError):
    """A line of the bundle that is not a ledger row; the message says why."""


def open_file(directory: Path, name: str, what: str) -> BinaryIO:
    """The bundle file ``name``, opened to read; ``BundleError`` naming ``what`` it holds."""
    path = directory / name
    try:
        return path.open("rb")
    except OSError as exc:
        raise BundleError(f"{path}: cannot read {what} ({exc.strerror})") from None


BLOCK = 1024 * 1024  # bytes of records.jsonl read at a time
# The longest line of records.jsonl or checkpoints.jsonl read: above any line of a ledger
# within the service's limits (a 64 MiB state whose every byte the line escapes to 7,
# a 4 MiB patch alike, a receipt). A longer one is hashed and counted, never held.
MAX_LINE = 512 * 1024 * 1024


class _TooLong(bytes):
    """The line a ``LineReader`` hands out for one over its bound (never held)."""


TOO_LONG = _TooLong()


def record_lines(directory: Path, tally: Tally) -> LineReader:
    """The lines of ``records.jsonl``, read in blocks hashed into ``tally`` (whose line
    count is the reader's: ``Tally.lines_cut`` once read). A read that fails part way
    (a disk error, a network share gone) is ``BundleError``: what was not read is not
    verified, and a run must say so rather than end as if the file ended there."""
    handle = open_file(directory, RECORDS, "the records")
    return LineReader(_blocks(handle), 1, directory / RECORDS, tally.hashed)


def _blocks(handle: BinaryIO) -> Iterator[bytes]:
    with handle:
        while block := handle.read(BLOCK):
            yield block


class LineReader:
    """The numbered lines (without their newlines) of a file read as blocks: each line
    handed out in turn, or taken whole from its block by the compiled lane (``feed``).
    A last line without its newline is a line. Keeps the first and the last line, and
    how many there were; a read that fails part way is ``BundleError``."""

    def __init__(
        self,
        blocks: Iterator[bytes],
        number: int,
        path: Path,
        seen: Callable[[bytes], object] | None = None,
    ) -> None:
        self._blocks = blocks
        self._path = path
        self._seen = seen  # each block, as read (a hash)
        self._block = b""
        self._pos = 0
        self._first_number = number
        self.number = number  # the next line's
        self.first: bytes | None = None
        self._last: bytes | tuple[bytes, int, int] | None = None

    @property
    def count(self) -> int:
        """The lines handed out or taken so far."""
        return self.number - self._first_number

    @property
    def last(self) -> bytes | None:
        if isinstance(self._last, tuple):
            block, start, end = self._last
            self._last = block[start:end]
        return self._last

    def feed(self, lane: Any) -> bool:
        """Let ``lane`` take the whole lines of the current block it confirms. False
        when it declined one (the next line handed out), True when it stopped at the
        end of the block (the next line may continue the chain)."""
        pos, taken, last = lane.feed(self._block, self._pos)
        if taken:
            if self.first is None:
                self.first = self._block[self._pos : self._block.index(b"\n", self._pos)]
            self._last = (self._block, last, pos - 1)
            self._pos = pos
            self.number += taken
        return self._block.find(b"\n", pos) < 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return self

    def __next__(self) -> tuple[int, bytes]:
        """The next line, or ``TOO_LONG`` for one over ``MAX_LINE`` bytes: read to its
        end (and hashed) but never held, so that a file that is one endless line
        costs no more memory than a line may."""
        parts: list[bytes] = []  # the line read so far, when it spans blocks
        held = 0  # its length (counted on past MAX_LINE, when parts are dropped)
        while True:
            end = self._block.find(b"\n", self._pos)
            if end >= 0:
                piece = self._block[self._pos : end]
                self._pos = end + 1
                if held + len(piece) > MAX_LINE:
                    return self._line(TOO_LONG)
                return self._line(b"".join((*parts, piece)) if parts else piece)
            if self._pos < len(self._block):
                held += len(self._block) - self._pos
                if held <= MAX_LINE:
                    parts.append(self._block[self._pos :])
                else:
                    parts.clear()
            self._block, self._pos = b"", 0
            try:
                block = next(self._blocks, b"")
            except OSError as exc:
                raise read_failed(self._path, self.number - 1, exc) from None
            if not block:
                if held > MAX_LINE:
                    return self._line(TOO_LONG)
                if parts:
                    return self._line(b"".join(parts))
                raise StopIteration
            if self._seen is not None:
                self._seen(block)
            self._block = block

    def _line(self, line: bytes) -> tuple[int, bytes]:
        number = self.number
        self.number += 1
        if self.first is None:
            self.first = line
        self._last = line
        return number, line


def read_failed(path: Path, lines: int, exc: OSError) -> BundleError:
    """A read of a bundle file that failed after ``lines`` lines: no end of file, but
    what was not read is not verified, and the run must say so."""
    return BundleError(
        f"{path}: reading failed after line {lines} ({exc.strerror}): "
        "the rest of the bundle is not verified"
    )


def line_finding(number: int, problem: LineProblem) -> Finding:
    return Finding(None, None, BUNDLE_LINE, "a ledger row", f"line {number}: {problem}")


def check_records_file(manifest: Manifest, read: Tally, threads: int, report: Report) -> None:
    """Compare what was read of ``records.jsonl`` with the manifest's packing list."""
    sha256, lines = read.sha256, read.lines
    if sha256 != manifest.records_sha256:
        report(
            Finding(
                None,
                None,
                BUNDLE_HASH,
                f"{RECORDS} with SHA-256 {manifest.records_sha256} (the manifest's)",
                f"SHA-256 {sha256}",
            )
        )
    if (lines, threads) != (manifest.records, manifest.threads):
        report(
            Finding(
                None,
                None,
                BUNDLE_COUNT,
                f"{manifest.records} lines of {manifest.threads} threads (the manifest's)",
                f"{lines} lines of {threads} threads",
            )
        )


def _too_long() -> LineProblem:
    return LineProblem(f"too long (over {MAX_LINE} bytes): not read")


def row_from_line(line: bytes) -> LedgerRow:
    """The ledger row one line of ``records.jsonl`` holds; ``LineProblem`` if none."""
    if line is TOO_LONG:
        raise _too_long()
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise LineProblem("not JSON") from None
    if not isinstance(doc, dict) or doc.keys() != _LINE_MEMBER_SET:
        raise LineProblem(f"not an object with exactly the members {', '.join(LINE_MEMBERS)}")
    if not (
        _STR.issuperset(map(type, _TEXT(doc)))
        and _STR_OR_NULL.issuperset(map(type, _OPTIONAL(doc)))
    ):
        for name in _TEXT_MEMBERS:
            if not isinstance(doc[name], str):
                raise LineProblem(f"{name} must be a string")
        for name in _OPTIONAL_TEXT:
            if doc[name] is not None and not isinstance(doc[name], str):
                raise LineProblem(f"{name} must be a string or null")
    if type(doc["version"]) is not int:
        raise LineProblem("version must be an integer")
    record = _blob_in(doc["record"], "record")
    if record is None:
        raise LineProblem("record must not be null")
    return LedgerRow(
        thread_id=doc["thread_id"],
        version=doc["version"],
        digest=doc["digest"],
        parent_digest=doc["parent_digest"],
        node_id=doc["node_id"],
        key_id=doc["key_id"],
        signature=doc["signature"],
        record=record,
        state=_blob_in(doc["state"], "state"),
        receipt=_blob_in(doc["receipt"], "receipt"),
        receipt_signature=doc["receipt_signature"],
        receipt_key_id=doc["receipt_key_id"],
        committed_at=doc["committed_at"],
    )


def _blob_in(value: Any, name: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, dict) and list(value) == ["base64"] and isinstance(value["base64"], str):
        try:
            return base64.b64decode(value["base64"], validate=True)
        except (binascii.Error, ValueError):
            pass
    raise LineProblem(f"{name} must be text, {{'base64': ...}} or null")


Checkpoint = tuple[str, int, SignedCheckpoint]  # thread id, version, the signed head


def checkpoint_entries(
    handle: BinaryIO, path: Path, manifest: Manifest, report: Report, read: Tally | None = None
) -> Iterator[Checkpoint]:
    """The checkpoints of ``handle`` (the bundle's ``checkpoints.jsonl``, at ``path``)
    in file order, read as they are asked for, the handle closed at the end. A line
    that is no checkpoint, or comes before the thread it follows, is reported; after
    the last line, the file's hash and line count (taken into ``read``) are compared
    with the manifest."""
    read = read if read is not None else Tally()
    last_thread: str | None = None
    lines = LineReader(_blocks(handle), 1, path, read.hashed)
    with handle:
        for number, line in lines:
            try:
                entry = checkpoint_from_line(line)
            except LineProblem as problem:
                found = f"line {number}: {problem}"
                report(Finding(None, None, BUNDLE_CHECKPOINT, "a checkpoint", found))
                continue
            if last_thread is not None and entry[0] < last_thread:
                report(
                    Finding(
                        entry[0],
                        entry[1],
                        BUNDLE_ORDER,
                        "checkpoints in thread id order",
                        f"line {number} comes after thread {shown(last_thread)}",
                    )
                )
            last_thread = entry[0]
            yield entry
    read.lines_cut(lines.count)
    check_packed(read, CHECKPOINTS, manifest.checkpoints_sha256, manifest.checkpoints, report)


class CheckpointReader:
    """Checkpoints taken thread by thread in one pass, in step with the records (both
    are in code point order of thread id): from the bundle's file
    (``checkpoint_entries``), or, on a worker of ``--jobs``, the part of it that
    concerns the worker's threads.

    A checkpoint of a thread with no records (before the thread taken next, or left
    at the end) is reported: the chain no longer passes through a signed head.
    """

    def __init__(self, entries: Iterator[Checkpoint], report: Report, *, thread_id: str | None):
        self._entries, self._report, self._only = entries, report, thread_id
        self._next: Checkpoint | None = next(self._entries, None)

    def take(self, thread_id: str) -> dict[int, SignedCheckpoint]:
        """The checkpoints of ``thread_id``; those of threads before it have no records."""
        taken: dict[int, SignedCheckpoint] = {}
        while self._next is not None and self._next[0] <= thread_id:
            owner, version, checkpoint = self._next
            if owner == thread_id:
                taken[version] = checkpoint
            else:
                self._orphan(owner, version)
            self._next = next(self._entries, None)
        return taken

    def _orphan(self, thread_id: str, version: int) -> None:
        if self._only is None or self._only == thread_id:
            self._report(
                Finding(
                    thread_id,
                    version,
                    CHECKPOINT,
                    f"a record at version {version} (a signed head)",
                    "no record of the thread in the bundle",
                )
            )

    def finish(self) -> None:
        """Report the checkpoints left (and, from the file, its hash and count)."""
        while self._next is not None:
            self._orphan(self._next[0], self._next[1])
            self._next = next(self._entries, None)


def checkpoint_from_line(line: bytes) -> Checkpoint:
    """The checkpoint one line of ``checkpoints.jsonl`` holds; ``LineProblem`` if none."""
    if line is TOO_LONG:
        raise _too_long()
    try:
        return parse_checkpoint_line(line)
    except CheckpointInvalid as exc:
        raise LineProblem(exc.message) from None


# --- verification -----------------------------------------------------------------------


def usable_manifest(directory: Path, run: Verification) -> Manifest:
    """The bundle's manifest, if the bundle can be verified with ``run.trust`` at all;
    ``run.trust`` then knows the policy versions the bundle carries."""
    manifest, manifest_sha256 = read_manifest(directory)
    if run.trust.keyring is None and manifest.checkpoints is None:
        raise BundleError(
            f"{directory}: a format 1 bundle carries no checkpoints, which public-only "
            "verification needs; export it again"
        )
    check_manifest_signature(directory, manifest_sha256, run)
    if manifest.policies is not None:
        stored = read_policies(directory, manifest, run.finding)
        run.trust = admit_policy_versions(run.trust, stored, run.finding)
    stored_names = {policy.name for policy in run.trust.stored}
    check_policies_named(set(manifest.policy_digests), run.trust, stored_names)
    return manifest


def check_manifest_signature(directory: Path, manifest_sha256: str, run: Verification) -> None:
    """A ``manifest.sig`` must verify under a checkpoint key and name ``manifest_sha256``,
    the SHA-256 of the manifest bytes verified (checked whenever the checkpoint keys are
    at hand); its absence is a finding only when the verifier requires one
    (``--signed-manifest``)."""
    expected = f"a {MANIFEST} whose SHA-256 a checkpoint key signed ({MANIFEST_SIG})"
    path = directory / MANIFEST_SIG
    try:
        with path.open("rb") as handle:
            signature = handle.read(MAX_MANIFEST_SIG + 1)  # never more in memory
    except FileNotFoundError:
        if run.trust.require_signed_manifest:
            run.finding(Finding(None, None, BUNDLE_MANIFEST, expected, f"no {MANIFEST_SIG}"))
        return
    except OSError as exc:
        raise BundleError(f"{path}: cannot read ({exc.strerror})") from None
    keys = run.trust.checkpoint_keys
    if keys is None:
        return
    if len(signature) > MAX_MANIFEST_SIG:
        found = f"a {MANIFEST_SIG} longer than {MAX_MANIFEST_SIG:,} bytes"
        run.finding(Finding(None, None, BUNDLE_MANIFEST, expected, found))
        return
    try:
        verify_manifest_signature(signature, manifest_sha256, dict(keys))
    except CheckpointInvalid as exc:
        run.finding(Finding(None, None, BUNDLE_MANIFEST, expected, exc.message))


def read_policies(directory: Path, manifest: Manifest, report: Report) -> list[StoredPolicy]:
    """The policy versions of ``policies.jsonl``, read line by line; a line that is not
    one, and a file the manifest does not describe, are reported. A line too long to
    hold a policy the verifier would read is hashed and counted, never held whole, and
    reported as the line it is (it has no digest the verifier read)."""
    path = directory / POLICIES
    read = Tally()
    versions: list[StoredPolicy] = []
    try:
        with path.open("rb") as handle:
            while line := handle.readline(MAX_POLICY_LINE + 1):  # never more in memory
                number = read.line(line)
                if len(line) > MAX_POLICY_LINE:
                    while not line.endswith(b"\n") and (line := handle.readline(1 << 20)):
                        read.rest(line)  # the rest of the line: hashed, not kept
                    report(Finding(None, None, BUNDLE_LINE, "a policy version", too_long(number)))
                    continue
                try:
                    versions.append(_policy_from_line(line))
                except LineProblem as problem:
                    found = f"{POLICIES} line {number}: {problem}"
                    report(Finding(None, None, BUNDLE_LINE, "a policy version", found))
    except OSError as exc:
        raise BundleError(f"{path}: cannot read the policies ({exc.strerror})") from None
    check_packed(read, POLICIES, manifest.policies_sha256, manifest.policies, report)
    return versions


def check_packed(
    read: Tally, name: str, sha256: str | None, lines: int | None, report: Report
) -> None:
    """Compare what was read of the bundle file ``name`` (checkpoints or policies) with
    the manifest's packing list: its SHA-256 and its count of lines."""
    found = read.sha256
    if found != sha256:
        expected = f"{name} with SHA-256 {sha256} (the manifest's)"
        report(Finding(None, None, BUNDLE_HASH, expected, f"SHA-256 {found}"))
    if read.lines != lines:
        expected = f"{lines} lines of {name} (the manifest's)"
        report(Finding(None, None, BUNDLE_COUNT, expected, f"{read.lines} lines"))


def too_long(number: int) -> str:
    """What a ``policies.jsonl`` line over ``MAX_POLICY_LINE`` bytes is found to be."""
    return f"{POLICIES} line {number}: too long (over {MAX_POLICY_LINE} bytes): not read"


def _policy_from_line(line: bytes) -> StoredPolicy:
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise LineProblem("not JSON") from None
    if not isinstance(doc, dict) or doc.keys() != set(POLICY_MEMBERS):
        raise LineProblem(f"not an object with exactly the members {', '.join(POLICY_MEMBERS)}")
    if not isinstance(doc["policy_digest"], str) or not isinstance(doc["policy_name"], str):
        raise LineProblem("policy_digest and policy_name must be strings")
    body = _blob_in(doc["body"], "body")
    if body is None:
        raise LineProblem("body must not be null")
    return StoredPolicy(doc["policy_digest"], doc["policy_name"], body, len(body))


def verify_bundle(
    directory: Path, trust: Trust, report: Report, *, thread_id: str | None = None
) -> Summary:
    """Verify the bundle in ``directory`` (every thread, or one) with no database.

    Checkpoints are checked whenever the trust holds their public keys; public-only
    verification (no HMAC keyring) needs a bundle that carries them."""
    run = Verification(trust, report)
    manifest = usable_manifest(directory, run)
    trust = run.trust
    checkpoints = (
        CheckpointReader(
            checkpoint_entries(
                open_file(directory, CHECKPOINTS, "the checkpoints"),
                directory / CHECKPOINTS,
                manifest,
                run.finding,
            ),
            run.finding,
            thread_id=thread_id,
        )
        if checks_checkpoints(trust, manifest)
        else None
    )
    read = Tally()
    order = ThreadOrder(run.finding)
    lines = record_lines(directory, read)
    with collector_frozen():
        threads = verify_lines(
            run, manifest, lines, checkpoints=checkpoints, thread_id=thread_id, group=order.group
        )
    read.lines_cut(lines.count)
    check_records_file(manifest, read, len(threads), run.finding)
    if checkpoints is not None:
        checkpoints.finish()
    finish_bundle(run, manifest, order.seen, thread_id)
    return run.summary


def checks_checkpoints(trust: Trust, manifest: Manifest) -> bool:
    """Whether a run checks the bundle's checkpoints: when it carries them and the
    trust holds their public keys."""
    return trust.checkpoint_keys is not None and manifest.checkpoints is not None


def verify_lines(
    run: Verification,
    manifest: Manifest,
    lines: LineReader,
    *,
    checkpoints: CheckpointReader | None,
    thread_id: str | None,
    group: Callable[[str, int], None],
) -> set[str]:
    """Verify the numbered ``lines`` of ``records.jsonl`` (all of them, or a worker's
    part), thread group by thread group, each group's first row told to ``group``
    before its checks; the threads they hold (``thread_id`` or not).

    Lines that are not rows are reported and skipped; they do not end a group."""
    threads: set[str] = set()
    current: ThreadVerifier | None = None
    lane = run.lane  # the compiled lane: the lines it confirms whole, it takes
    in_lane = False

    def fed(thread: ThreadVerifier) -> bool:
        """The rest of the block to the lane, which holds ``thread``'s chain: whether it
        still does (False: it declined a line, the next one read, and the reference has
        the chain back, so that no line is offered to the lane twice)."""
        if lines.feed(lane):
            return True
        thread.lane_take(lane)
        return False

    for number, line in lines:
        if in_lane:
            assert current is not None
            if lane.add(line):  # the first line of a block, or one across two
                in_lane = fed(current)
                continue
            current.lane_take(lane)
            in_lane = False
        try:
            row = row_from_line(line)
        except LineProblem as problem:
            run.finding(line_finding(number, problem))
            continue
        threads.add(row.thread_id)
        if thread_id is not None and row.thread_id != thread_id:
            continue
        if current is None or row.thread_id != current.thread_id:
            if current is not None:
                current.check_head(head_of(manifest, current.thread_id))
            group(row.thread_id, row.version)
            current = run.thread(row.thread_id)
            if checkpoints is not None:
                current.expect_checkpoints(checkpoints.take(row.thread_id))
            if lane is not None and current.lane_start(lane):  # the lane from genesis
                if lane.add(line):
                    in_lane = fed(current)
                    continue
                current.lane_take(lane)
        current.add(row)
        if lane is not None and current.lane_start(lane):
            in_lane = fed(current)
    if current is not None:
        if in_lane:
            current.lane_take(lane)
        current.check_head(head_of(manifest, current.thread_id))
    return threads


class ThreadOrder:
    """The order of the thread groups of ``records.jsonl``: each thread's lines
    together, and the threads in code point order of thread id, as the exporter writes
    them (the checkpoints are merged in that order). A group out of place is reported."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self.seen: set[str] = set()
        self.last: str | None = None  # the thread of the last group

    def group(self, thread_id: str, version: int) -> None:
        """The next group begins: ``thread_id``'s, at ``version``."""
        if thread_id in self.seen:
            self.resumed(thread_id, version)
        elif self.last is not None and thread_id < self.last:
            self.after(thread_id, version, self.last)
        self.seen.add(thread_id)
        self.last = thread_id

    def resumed(self, thread_id: str, version: int) -> None:
        """Report a group of a thread whose lines came before, after another thread's."""
        expected = "each thread's lines together, in version order"
        found = "the thread's lines resume after another thread's"
        self._report(Finding(thread_id, version, BUNDLE_ORDER, expected, found))

    def after(self, thread_id: str, version: int, greater: str) -> None:
        """Report a group that comes after a group of the ``greater`` thread id."""
        expected = "threads in code point order of thread id"
        found = f"the thread's lines come after those of thread {shown(greater)}"
        self._report(Finding(thread_id, version, BUNDLE_ORDER, expected, found))


def finish_bundle(
    run: Verification, manifest: Manifest, seen: set[str], thread_id: str | None
) -> None:
    """After the records: the manifest's threads with no records, and the kept
    checkpoints of threads the bundle holds nothing of."""
    if (
        thread_id is not None
        and thread_id not in seen
        and thread_id not in manifest.heads
        and thread_id not in run.trust.kept_checkpoints
    ):
        raise no_such_thread(thread_id)
    wanted = set(manifest.heads) if thread_id is None else {thread_id}
    for missing in sorted(wanted - seen):
        run.headless(missing, head_of(manifest, missing))
    for verified in seen:
        run.saw(verified)
    run.kept_threads_missing(thread_id)


def head_of(manifest: Manifest, thread_id: str) -> Head | None:
    head = manifest.heads.get(thread_id)
    return None if head is None else Head(head[0], head[1], None)
