"""Key files: the HMAC chain keyring, and the Ed25519 signing keys and public keyrings.

HMAC keys come from a JSON file or an environment variable, never from the database,
and never appear in a repr, a log line or an error. The document is::

    {"current": "k1", "keys": {"k1": "<base64 of >= 32 random bytes>"}}

An Ed25519 signing key (approval receipts, checkpoints) is a PKCS#8 PEM file of mode
0600; its public keyring, what workers and auditors hold, is::

    {"<key id>": "<base64 of the 32-byte raw Ed25519 public key>", ...}
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ztate.contract.errors import KeyFileError, KeyringError
from ztate.contract.files import FileTooLarge, read_bounded

KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
MIN_KEY_BYTES = 32
# a keyring, a public key file or a PEM key is a few hundred bytes a key: a file over
# 1 MiB (ten thousand keys) is refused, read no further
MAX_KEY_FILE_BYTES = 1024 * 1024
PublicKeys = dict[str, Ed25519PublicKey]


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
            text = read_bounded(path, MAX_KEY_FILE_BYTES, "a keyring").decode("utf-8")
        except OSError as exc:
            raise KeyringError(f"{path}: cannot read the keyring ({exc.strerror})") from None
        except FileTooLarge as exc:
            raise KeyringError(str(exc)) from None
        except UnicodeDecodeError:
            raise KeyringError(f"{path}: the keyring is not UTF-8") from None
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
    replaced atomically (a temp file in the same folder, then a rename), so a crash
    leaves either the old keyring or the new one, never half of one. The new file
    keeps the old one's owner and group (where this user may set them) and its
    permissions less any for others: a keyring a service reads through its group
    stays readable to it. It is read as the service reads it (at most 1 MiB).
    Returns the new key id; never the key.
    """
    keyring = Keyring.load(path, None)
    try:
        before = path.stat()
    except OSError as exc:
        raise KeyringError(f"{path}: cannot read the keyring ({exc.strerror})") from None
    chosen = key_id if key_id is not None else new_key_id(keyring.key_ids)
    if not KEY_ID.match(chosen):
        raise KeyringError(f"key id {chosen!r} must be 1-64 characters of [A-Za-z0-9._-]")
    if chosen in keyring.key_ids:
        raise KeyringError(f"{path}: key id {chosen!r} already exists; key ids are never reused")
    keys = {kid: base64.b64encode(keyring.key(kid)).decode() for kid in keyring.key_ids}
    keys[chosen] = base64.b64encode(secrets.token_bytes(32)).decode()
    _write_atomically(path, json.dumps({"current": chosen, "keys": keys}), like=before)
    return chosen


def _write_atomically(path: Path, text: str, *, like: os.stat_result | None = None) -> None:
    """``text`` into ``path`` by a rename: mode 0600, or ``like``'s owner, group and
    permissions less any for others (and any the owner could not give)."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    if like is not None:
        with contextlib.suppress(PermissionError):  # only root gives a file away
            os.fchown(fd, like.st_uid, like.st_gid)
        os.fchmod(fd, stat.S_IMODE(like.st_mode) & 0o660)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


# --- Ed25519 signing keys and public keyrings -------------------------------------------


def write_private(path: Path, data: bytes) -> None:
    """A new file readable by its owner only; an existing file is never overwritten."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _new_signing_key() -> tuple[bytes, str]:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return pem, base64.b64encode(raw).decode()


def generate_signing_key(private_path: Path, public_path: Path, key_id: str) -> None:
    """A new Ed25519 signing key (PEM, mode 0600) and the public keyring that verifies it."""
    if not KEY_ID.match(key_id):
        raise KeyFileError("key id must be 1-64 characters of [A-Za-z0-9._-]")
    pem, public = _new_signing_key()
    write_private(private_path, pem)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.write_text(json.dumps({key_id: public}, indent=2))


def add_signing_key(private_path: Path, public_path: Path, key_id: str) -> None:
    """A new Ed25519 signing key (PEM, mode 0600), its public half added to the public
    keyring at ``public_path`` (created if missing) under ``key_id``, which must be
    new there: rotating keeps the old public keys, so old signatures still verify.
    Nothing is written if the private file exists or the key id is taken."""
    if not KEY_ID.match(key_id):
        raise KeyFileError("key id must be 1-64 characters of [A-Za-z0-9._-]")
    if private_path.exists():
        raise KeyFileError(f"{private_path}: exists; a signing key is never overwritten")
    keyring: dict[str, str] = {}
    if public_path.exists():
        load_public_keys(public_path)  # refuses a malformed keyring before anything changes
        keyring = json.loads(public_path.read_text())
        if key_id in keyring:
            raise KeyFileError(f"{public_path}: already holds key id {key_id!r}")
    pem, keyring[key_id] = _new_signing_key()
    write_private(private_path, pem)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.write_text(json.dumps(keyring, indent=2))


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file; ``KeyFileError`` naming what is wrong."""
    try:
        pem = read_bounded(path, MAX_KEY_FILE_BYTES, "a signing key")
        key = serialization.load_pem_private_key(pem, password=None)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the signing key ({exc.strerror})") from None
    except FileTooLarge as exc:
        raise KeyFileError(str(exc)) from None
    except (ValueError, TypeError):
        raise KeyFileError(f"{path}: not an unencrypted PEM private key") from None
    except UnsupportedAlgorithm:  # a key of a curve or type cryptography lacks: not Ed25519
        raise KeyFileError(f"{path}: the signing key must be Ed25519") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: the signing key must be Ed25519")
    return key


def load_public_keys(path: str | Path) -> PublicKeys:
    """A public keyring file: ``{"<key id>": "<base64 of the raw 32-byte Ed25519 key>"}``,
    non-empty; ``KeyFileError`` naming what is wrong."""
    try:
        doc = json.loads(read_bounded(path, MAX_KEY_FILE_BYTES, "public keys"))
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read public keys ({exc.strerror})") from None
    except FileTooLarge as exc:
        raise KeyFileError(str(exc)) from None
    except ValueError:
        raise KeyFileError(f"{path}: public keys must be a JSON object") from None
    if not isinstance(doc, dict) or not doc:
        raise KeyFileError(f"{path}: public keys must be a non-empty JSON object")
    keys: PublicKeys = {}
    for key_id, encoded in doc.items():
        if not KEY_ID.match(key_id):
            raise KeyFileError(
                f"{path}: key id {key_id!r} must be 1-64 characters of [A-Za-z0-9._-]"
            )
        try:
            keys[key_id] = Ed25519PublicKey.from_public_bytes(
                base64.b64decode(str(encoded), validate=True)
            )
        except (binascii.Error, ValueError):
            raise KeyFileError(
                f"{path}: key {key_id!r} is not a base64 Ed25519 public key"
            ) from None
    return keys
