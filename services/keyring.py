"""The HMAC chain keys, by key id.

Keys come from a JSON file or an environment variable, never from the database,
and never appear in a repr, a log line or an error. The document is::

    {"current": "k1", "keys": {"k1": "<base64 of >= 32 random bytes>"}}
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
MIN_KEY_BYTES = 32


class KeyringError(ValueError):
    """The keyring document is unusable; the message never holds key material."""


@dataclass(frozen=True)
class Keyring:
    """HMAC keys by id, and which one signs new records."""

    current: str
    _keys: dict[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        if self.current not in self._keys:
            raise KeyringError(f"current key id {self.current!r} is not in the keyring")

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._keys))

    def key(self, key_id: str) -> bytes:
        """The key for ``key_id``; ``KeyError`` if this keyring does not hold it."""
        return self._keys[key_id]

    @classmethod
    def from_json(cls, text: str, *, source: str) -> Keyring:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KeyringError(f"{source}: not JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(doc, dict) or set(doc) != {"current", "keys"}:
            raise KeyringError(f"{source}: expected exactly the members 'current' and 'keys'")
        raw_keys = doc["keys"]
        if not isinstance(raw_keys, dict) or not raw_keys:
            raise KeyringError(f"{source}: 'keys' must be a non-empty object")
        keys: dict[str, bytes] = {}
        for key_id, encoded in raw_keys.items():
            if not KEY_ID.match(key_id):
                raise KeyringError(
                    f"{source}: key id {key_id!r} must be 1-64 characters of [A-Za-z0-9._-]"
                )
            try:
                material = base64.b64decode(str(encoded), validate=True)
            except (binascii.Error, ValueError):
                raise KeyringError(f"{source}: key {key_id!r} is not valid base64") from None
            if len(material) < MIN_KEY_BYTES:
                raise KeyringError(
                    f"{source}: key {key_id!r} is shorter than {MIN_KEY_BYTES} bytes"
                )
            keys[key_id] = material
        current = doc["current"]
        if not isinstance(current, str):
            raise KeyringError(f"{source}: 'current' must be a key id")
        return cls(current=current, _keys=keys)

    @classmethod
    def load(cls, path: Path | None, env_value: str | None) -> Keyring:
        """From ``env_value`` when set (a secret manager's injection), else from ``path``."""
        if env_value:
            return cls.from_json(env_value, source="ZTATE_HMAC_KEYRING")
        if path is None:
            raise KeyringError("no HMAC keyring: set ZTATE_HMAC_KEYRING or ZTATE_HMAC_KEYRING_FILE")
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise KeyringError(f"{path}: cannot read the keyring ({exc.strerror})") from None
        return cls.from_json(text, source=str(path))


def generate_keyring_file(path: Path, key_id: str = "k1") -> None:
    """Write a new keyring with one random key, readable by its owner only."""
    doc = {"current": key_id, "keys": {key_id: base64.b64encode(secrets.token_bytes(32)).decode()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(doc, handle)


def new_key_id(existing: tuple[str, ...]) -> str:
    """The next free ``kN`` id: rotation needs a fresh id, never a reused one."""
    number = len(existing) + 1
    while f"k{number}" in existing:
        number += 1
    return f"k{number}"


def rotate_keyring_file(path: Path, key_id: str | None = None) -> str:
    """Add a new random key to the keyring at ``path`` and make it current.

    Old keys stay, so records signed under them keep verifying. The file is
    replaced atomically (a 0600 temp file in the same folder, then a rename), so a
    crash leaves either the old keyring or the new one, never half of one.
    Returns the new key id; never the key.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyringError(f"{path}: cannot read the keyring ({exc.strerror})") from None
    keyring = Keyring.from_json(text, source=str(path))
    chosen = key_id if key_id is not None else new_key_id(keyring.key_ids)
    if not KEY_ID.match(chosen):
        raise KeyringError(f"key id {chosen!r} must be 1-64 characters of [A-Za-z0-9._-]")
    if chosen in keyring.key_ids:
        raise KeyringError(f"{path}: key id {chosen!r} already exists; key ids are never reused")
    keys = {kid: base64.b64encode(keyring.key(kid)).decode() for kid in keyring.key_ids}
    keys[chosen] = base64.b64encode(secrets.token_bytes(32)).decode()
    _write_atomically(path, json.dumps({"current": chosen, "keys": keys}))
    return chosen


def _write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
