"""The revocation list: certificates and identities refused although TLS accepts them.

A JSON file (docs/operations.md, "Revocation"), written by ``ztate ca revoke`` or by
any tool that writes the same format::

    {
      "format": "ztate-revocations/1",
      "revoked": [
        {"serial": "5c1f...", "revoked_at": "2025-01-02T03:04:05Z", "note": "laptop lost"},
        {"spiffe_id": "spiffe://ztate.local/node/planner", "revoked_at": "..."}
      ]
    }

An entry names exactly one of ``serial`` (one certificate, lower-case hexadecimal
without leading zeros: renewed certificates of the same identity still work) or
``spiffe_id`` (every certificate of that identity, past and future, until the entry is
removed). Both services read it again when it changes (``reloading``) and check it at
every call, so connections already open are refused too (``identity.Authenticator``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ztate.contract.files import read_bounded
from ztate.services.runtime.errors import IdentityInvalid, IdentityRevoked
from ztate.services.runtime.identity import TRUST_DOMAIN, parse_spiffe_id
from ztate.services.runtime.reloading import WatchedFiles, write_atomically

FORMAT = "ztate-revocations/1"
SERIAL = re.compile(r"^[0-9a-f]{1,64}\Z")  # RFC 5280 serials are at most 20 octets
MAX_NOTE = 256
log = logging.getLogger("ztate.revocation")
# 16 MiB: some 100,000 entries, read again by every replica at every change
MAX_LIST_BYTES = 16 * 1024 * 1024


class RevocationListError(ValueError):
    """The file is not a revocation list this version reads."""


def canonical_spiffe_id(text: str) -> str:
    """``text`` if it is a SPIFFE ID exactly as a certificate's would be read
    (``spiffe://<trust domain>/<role>/<name>``, lower case, nothing around it): an entry
    spelled any other way (a trailing slash, upper case, a space) would match no caller
    and revoke nothing while it seemed to. ``RevocationListError`` otherwise."""
    domain = text.removeprefix("spiffe://").partition("/")[0]
    try:
        if len(text) > 2048 or not TRUST_DOMAIN.fullmatch(domain):
            raise IdentityInvalid("not a trust domain")
        canonical = parse_spiffe_id(text, domain).spiffe_id
    except IdentityInvalid:
        canonical = None
    if canonical != text:
        raise RevocationListError(
            f"{text!r} is not a SPIFFE ID spiffe://<trust domain>/<role>/<name> "
            "as certificates carry it"
        )
    return text


def serial_text(serial: int) -> str:
    """A serial number as the list writes it."""
    return format(serial, "x")


def parse_serial(text: str) -> int:
    """A serial as people copy it: hexadecimal, with or without ``0x`` and colons
    (``openssl x509 -serial`` prints ``serial=5C1F...``)."""
    cleaned = text.strip().lower().removeprefix("serial=").removeprefix("0x").replace(":", "")
    if not SERIAL.fullmatch(cleaned):
        raise RevocationListError(f"{text!r} is not a hexadecimal certificate serial")
    return int(cleaned, 16)


@dataclass(frozen=True, slots=True)
class Entry:
    """One revocation: exactly one of ``serial`` and ``spiffe_id``."""

    serial: int | None
    spiffe_id: str | None
    revoked_at: str
    note: str = ""

    def as_json(self) -> dict[str, str]:
        found = {"serial": serial_text(self.serial)} if self.serial is not None else {}
        if self.spiffe_id is not None:
            found["spiffe_id"] = self.spiffe_id
        found["revoked_at"] = self.revoked_at
        if self.note:
            found["note"] = self.note
        return found


def _entry(raw: Any, where: str) -> Entry:
    if not isinstance(raw, dict) or not set(raw) <= {"serial", "spiffe_id", "revoked_at", "note"}:
        raise RevocationListError(
            f"{where}: an entry is an object of serial or spiffe_id, revoked_at and note"
        )
    serial, spiffe_id = raw.get("serial"), raw.get("spiffe_id")
    if (serial is None) == (spiffe_id is None):
        raise RevocationListError(f"{where}: an entry names exactly one of serial and spiffe_id")
    if serial is not None and not (isinstance(serial, str) and SERIAL.fullmatch(serial)):
        raise RevocationListError(f"{where}: serial must be lower-case hexadecimal")
    if spiffe_id is not None:
        if not (
            isinstance(spiffe_id, str)
            and spiffe_id.startswith("spiffe://")
            and len(spiffe_id) <= 2048
        ):
            raise RevocationListError(f"{where}: spiffe_id must be a SPIFFE ID")
        try:
            canonical_spiffe_id(spiffe_id)
        except RevocationListError as exc:
            # it matches no caller, as it never did: the list still loads (one entry
            # spelled wrong must not keep the valid ones beside it out), and says so.
            # `ztate ca revoke` refuses to write such an entry.
            log.warning("%s revokes nothing: %s", where, exc)
    revoked_at, note = raw.get("revoked_at"), raw.get("note", "")
    if not isinstance(revoked_at, str) or not isinstance(note, str) or len(note) > MAX_NOTE:
        raise RevocationListError(f"{where}: revoked_at is a time and note a short text")
    return Entry(int(serial, 16) if serial is not None else None, spiffe_id, revoked_at, note)


@dataclass(frozen=True, slots=True)
class RevocationList:
    """What the file says is revoked."""

    entries: tuple[Entry, ...] = ()
    serials: frozenset[int] = field(init=False)
    spiffe_ids: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        # looked up at every call: built once per list
        serials = frozenset(e.serial for e in self.entries if e.serial is not None)
        spiffe_ids = frozenset(e.spiffe_id for e in self.entries if e.spiffe_id is not None)
        object.__setattr__(self, "serials", serials)
        object.__setattr__(self, "spiffe_ids", spiffe_ids)

    @classmethod
    def parse(cls, data: bytes, where: str = "revocation list") -> RevocationList:
        try:
            document = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise RevocationListError(f"{where}: not JSON (or nested too deeply)") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise RevocationListError(f"{where}: not a {FORMAT} document")
        entries = document.get("revoked")
        if not isinstance(entries, list) or set(document) != {"format", "revoked"}:
            raise RevocationListError(f"{where}: holds format and a list revoked, nothing else")
        return cls(tuple(_entry(raw, f"{where}, entry {i}") for i, raw in enumerate(entries)))

    @classmethod
    def load(cls, path: Path, *, missing_revokes_nothing: bool = True) -> RevocationList:
        """The list in ``path``; a file that does not exist revokes nothing, or raises
        ``FileNotFoundError`` when ``missing_revokes_nothing`` is False (one open: a
        file removed after a check of its existence is never read as an empty list)."""
        try:
            data = read_bounded(path, MAX_LIST_BYTES, "a revocation list")  # FileTooLarge
        except FileNotFoundError:
            if not missing_revokes_nothing:
                raise
            return cls()
        return cls.parse(data, str(path))

    def to_bytes(self) -> bytes:
        document = {"format": FORMAT, "revoked": [e.as_json() for e in self.entries]}
        return (json.dumps(document, indent=2) + "\n").encode()

    def with_entry(self, entry: Entry) -> RevocationList:
        """The list with ``entry`` added, unless it already revokes the same thing."""
        if (entry.serial is not None and entry.serial in self.serials) or (
            entry.spiffe_id is not None and entry.spiffe_id in self.spiffe_ids
        ):
            return self
        return RevocationList((*self.entries, entry))

    def check(self, spiffe_id: str, serial: int | None) -> None:
        """Raise ``IdentityRevoked`` if this certificate or its identity is revoked."""
        if spiffe_id in self.spiffe_ids:
            raise IdentityRevoked(f"identity {spiffe_id} is revoked")
        if serial is not None and serial in self.serials:
            raise IdentityRevoked(f"certificate {serial_text(serial)} of {spiffe_id} is revoked")


def now_text() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def revoke(path: Path, entry: Entry) -> bool:
    """Add ``entry`` to the list in ``path`` (created if missing, mode 0644); False when
    it was already revoked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # one writer at a time (two `ztate ca revoke` at once: each would write the list it
    # read plus its own entry, and the last rename would drop the other's): a lock on
    # the folder, which leaves no file behind
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        current = RevocationList.load(path)
        updated = current.with_entry(entry)
        if updated is current:
            return False
        data = updated.to_bytes()
        RevocationList.parse(data, str(path))  # never write what the services would not read
        write_atomically(path, data, 0o644)
        return True
    finally:
        os.close(folder)  # and the lock with it


class Revocations:
    """The revocation list of a running service, read again when its file changes.

    A list that does not exist at start revokes nothing; one that later disappears or
    stops parsing keeps the last list read (and is logged): losing the file must not
    forgive every revoked identity.
    """

    def __init__(self, path: Path) -> None:
        def build() -> RevocationList:
            return RevocationList.load(path, missing_revokes_nothing=not self._started)

        self._started = False
        self._files = WatchedFiles(f"revocation list {path}", (path,), build)
        self._started = True

    def check(self, spiffe_id: str, serial: int | None) -> None:
        """Raise ``IdentityRevoked`` if revoked in the list as it is now."""
        self._files.current().check(spiffe_id, serial)
