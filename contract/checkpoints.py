"""Checkpoints: a thread's head, signed with a public-key signature.

The HMAC chain needs the HMAC key to verify, and whoever holds that key could
rewrite a consistent chain. So the transition service also signs, every
``checkpoint_interval`` seconds, each thread head that moved since its last
checkpoint with an Ed25519 key. Anyone with the public key can then check, with
no secret at all, that the chain links hash correctly from genesis and pass
through every signed head (``ztate verify --public-only``).

    checkpoint_bytes = JCS({"format": 1, "kind": "checkpoint", "thread_id", "version",
                            "head_digest", "signed_at", "key_id"})
    signature        = hex(Ed25519.sign(key, checkpoint_bytes))
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ztate.contract.canonical import JsonObject, canonical_bytes
from ztate.contract.errors import CheckpointInvalid
from ztate.contract.record import HEX_256, format_time, parse_time, shown
from ztate.contract.signed import signed_object

CHECKPOINT_FORMAT = 1
KIND_CHECKPOINT = "checkpoint"
MEMBERS = frozenset(
    {"format", "kind", "thread_id", "version", "head_digest", "signed_at", "key_id"}
)


@dataclass(frozen=True, slots=True)
class SignedCheckpoint:
    checkpoint: bytes
    signature: str
    key_id: str


def sign_checkpoint(
    key: Ed25519PrivateKey,
    key_id: str,
    *,
    thread_id: str,
    version: int,
    head_digest: str,
    signed_at: datetime,
) -> SignedCheckpoint:
    body: JsonObject = {
        "format": CHECKPOINT_FORMAT,
        "kind": KIND_CHECKPOINT,
        "thread_id": thread_id,
        "version": version,
        "head_digest": head_digest,
        "signed_at": format_time(signed_at),
        "key_id": key_id,
    }
    data = canonical_bytes(body)
    return SignedCheckpoint(data, key.sign(data).hex(), key_id)


def verify_checkpoint(
    signed: SignedCheckpoint, public_keys: dict[str, Ed25519PublicKey]
) -> JsonObject:
    """The checkpoint's content, once its signature and form check out.

    Raises ``CheckpointInvalid`` with check ``checkpoint.signature`` (no such key,
    or the signature does not verify) or ``checkpoint.form``. Nothing unsigned is
    ever parsed.
    """
    body = signed_object(
        signed.checkpoint,
        signed.signature,
        signed.key_id,
        public_keys,
        what="checkpoint",
        signer="checkpoint",
        members=MEMBERS,
        error=CheckpointInvalid,
    )
    if (body["format"], body["kind"], body["key_id"]) != (
        CHECKPOINT_FORMAT,
        KIND_CHECKPOINT,
        signed.key_id,
    ):
        raise CheckpointInvalid("unsupported checkpoint format, kind or key id")
    if not (
        isinstance(body["thread_id"], str)
        and type(body["version"]) is int
        and body["version"] >= 0
        and isinstance(body["head_digest"], str)
        and HEX_256.match(body["head_digest"])
        and parse_time(body["signed_at"]) is not None
    ):
        raise CheckpointInvalid("a member of the checkpoint has the wrong type or form")
    return body


# --- kept elsewhere: one line per signed checkpoint ----------------------------------------

LINE_MEMBERS = frozenset({"thread_id", "version", "checkpoint", "signature", "key_id"})


def checkpoint_line(thread_id: str, version: int, signed: SignedCheckpoint) -> bytes:
    """One line of a checkpoint file: a bundle's ``checkpoints.jsonl`` and the signer's
    journal (docs/verification.md, "Checkpoints kept elsewhere"). ``checkpoint`` holds
    the exact signed bytes as text, or ``{"base64": ...}`` if they are not UTF-8 (only a
    tampered checkpoint is not)."""
    try:
        body: object = signed.checkpoint.decode("utf-8")
    except UnicodeDecodeError:
        body = {"base64": base64.b64encode(signed.checkpoint).decode("ascii")}
    doc = {
        "thread_id": thread_id,
        "version": version,
        "checkpoint": body,
        "signature": signed.signature,
        "key_id": signed.key_id,
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def parse_checkpoint_line(line: bytes) -> tuple[str, int, SignedCheckpoint]:
    """A line of a checkpoint file as ``checkpoint_line`` writes it: the thread and
    version it claims (to be compared with the signed content) and the checkpoint.
    ``CheckpointInvalid`` (check ``checkpoint.line``) names what is wrong; the
    signature is not checked here (``verify_checkpoint``)."""
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        raise CheckpointInvalid("not JSON", check="checkpoint.line") from None
    if not isinstance(doc, dict) or doc.keys() != LINE_MEMBERS:
        members = ", ".join(sorted(LINE_MEMBERS))
        raise CheckpointInvalid(
            f"not an object with exactly the members {members}", check="checkpoint.line"
        )
    for name in ("thread_id", "signature", "key_id"):
        if not isinstance(doc[name], str):
            raise CheckpointInvalid(f"{name} must be a string", check="checkpoint.line")
    if type(doc["version"]) is not int:
        raise CheckpointInvalid("version must be an integer", check="checkpoint.line")
    body = doc["checkpoint"]
    if isinstance(body, str):
        data = body.encode("utf-8", "surrogatepass")
    elif isinstance(body, dict) and body.keys() == {"base64"} and isinstance(body["base64"], str):
        try:
            data = base64.b64decode(body["base64"], validate=True)
        except (binascii.Error, ValueError):
            raise CheckpointInvalid(
                "checkpoint is not valid base64", check="checkpoint.line"
            ) from None
    else:
        raise CheckpointInvalid(
            'checkpoint must be text or {"base64": ...}', check="checkpoint.line"
        )
    return doc["thread_id"], doc["version"], SignedCheckpoint(data, doc["signature"], doc["key_id"])


# --- bundle manifests, signed with the checkpoint key -------------------------------------

# The checkpoint key also signs the manifest of a bundle it exports (``ztate ledger
# export`` where the key is at hand): the statement names the SHA-256 of the exact
# manifest bytes, and the manifest names the SHA-256 of every other file, so the
# signature covers the whole bundle. Its kind keeps it from being read as a checkpoint.
KIND_MANIFEST = "bundle_manifest"
MANIFEST_MEMBERS = frozenset({"format", "kind", "manifest_sha256", "signed_at", "key_id"})
MANIFEST_SIGNATURE_MEMBERS = frozenset({"statement", "signature", "key_id"})


def sign_manifest(
    key: Ed25519PrivateKey, key_id: str, *, manifest_sha256: str, signed_at: datetime
) -> bytes:
    """``manifest.sig``: one JSON line ``{"statement", "signature", "key_id"}``, the
    statement the canonical text of ``{"format": 1, "kind": "bundle_manifest",
    "manifest_sha256", "signed_at", "key_id"}`` and the signature Ed25519 over it."""
    statement = canonical_bytes(
        {
            "format": CHECKPOINT_FORMAT,
            "kind": KIND_MANIFEST,
            "manifest_sha256": manifest_sha256,
            "signed_at": format_time(signed_at),
            "key_id": key_id,
        }
    )
    line = {
        "statement": statement.decode(),
        "signature": key.sign(statement).hex(),
        "key_id": key_id,
    }
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


def verify_manifest_signature(
    data: bytes, manifest_sha256: str, public_keys: dict[str, Ed25519PublicKey]
) -> JsonObject:
    """The signed statement of a ``manifest.sig``, once it verifies under a checkpoint
    key and names ``manifest_sha256``. Raises ``CheckpointInvalid`` saying why not."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise CheckpointInvalid("manifest.sig is not JSON", check="checkpoint.form") from None
    if (
        not isinstance(doc, dict)
        or doc.keys() != MANIFEST_SIGNATURE_MEMBERS
        or not all(isinstance(doc[name], str) for name in MANIFEST_SIGNATURE_MEMBERS)
    ):
        raise CheckpointInvalid(
            "manifest.sig is not {statement, signature, key_id} as strings",
            check="checkpoint.form",
        )
    body = signed_object(
        doc["statement"].encode("utf-8", "surrogatepass"),
        doc["signature"],
        doc["key_id"],
        public_keys,
        what="manifest signature",
        signer="checkpoint",
        members=MANIFEST_MEMBERS,
        error=CheckpointInvalid,
    )
    if (body["format"], body["kind"], body["key_id"]) != (
        CHECKPOINT_FORMAT,
        KIND_MANIFEST,
        doc["key_id"],
    ):
        raise CheckpointInvalid("unsupported manifest signature format, kind or key id")
    if body["manifest_sha256"] != manifest_sha256:
        raise CheckpointInvalid(
            f"the signature covers a manifest with SHA-256 {body['manifest_sha256']}, "
            f"not this one ({manifest_sha256})"
        )
    return body


# --- the same head as a C2SP signed note ------------------------------------------------

# A checkpoint can also travel as a signed note (https://github.com/C2SP/C2SP/blob/main/
# signed-note.md), the envelope transparency-log tooling verifies (Go's
# golang.org/x/mod/sumdb/note, for one). Its text is shaped like a tlog-checkpoint:
#
#     <origin>\n<size>\n<base64 head digest>\n
#
# with origin "<authority>/ztate/thread/<thread id>", size the number of records (version
# + 1) and the third line the head record's digest, base64 as tlog-checkpoint writes its
# root hash. It is NOT a Merkle tree head: a thread is a hash chain, so there are no
# inclusion or consistency proofs, and a witness that checks tlog consistency cannot
# cosign it; a verifier checks consistency by walking the records (ztate verify
# --checkpoints). docs/verification.md says so.
NOTE_ALGORITHM_ED25519 = 0x01
_EM_DASH = "\u2014"


def note_text(body: JsonObject, authority: str) -> bytes:
    """The text of a checkpoint's signed note, from a verified checkpoint ``body``."""
    if not authority or any(c.isspace() or c == "+" for c in authority):
        raise ValueError("the note's authority must be a non-empty name without spaces or '+'")
    digest = base64.b64encode(bytes.fromhex(body["head_digest"])).decode()
    origin = f"{authority}/ztate/thread/{body['thread_id']}"
    return f"{origin}\n{body['version'] + 1}\n{digest}\n".encode()


def note_key_hash(name: str, public_key: Ed25519PublicKey) -> bytes:
    """The 4-byte key hash of signed-note: SHA-256(name || 0x0A || 0x01 || key)[:4]."""
    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return hashlib.sha256(name.encode() + b"\n" + bytes([NOTE_ALGORITHM_ED25519]) + raw).digest()[
        :4
    ]


def note_verifier_key(name: str, public_key: Ed25519PublicKey) -> str:
    """The verifier key as note tooling reads it: ``<name>+<hash hex>+<base64(0x01||key)>``."""
    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    encoded = base64.b64encode(bytes([NOTE_ALGORITHM_ED25519]) + raw).decode()
    return f"{name}+{note_key_hash(name, public_key).hex()}+{encoded}"


def sign_note(text: bytes, name: str, key: Ed25519PrivateKey) -> bytes:
    """The signed note: ``text``, a blank line, and one signature line
    ``— <name> <base64(key hash || Ed25519 signature over text)>``."""
    if not text.endswith(b"\n") or b"\n\n" in text:
        raise ValueError("a note's text is non-empty lines, each ending in a newline")
    signature = note_key_hash(name, key.public_key()) + key.sign(text)
    line = f"{_EM_DASH} {name} {base64.b64encode(signature).decode()}\n"
    return text + b"\n" + line.encode()


def verify_note(note: bytes, name: str, public_key: Ed25519PublicKey) -> bytes:
    """The text of ``note`` once a signature line by ``name`` verifies under
    ``public_key`` (other signers' lines are ignored, as signed-note says).
    Raises ``CheckpointInvalid`` otherwise."""
    text, separator, signatures = note.rpartition(b"\n\n")
    if not separator or not signatures.endswith(b"\n"):
        raise CheckpointInvalid("not a signed note (no blank line before its signatures)")
    text += b"\n"
    wanted = note_key_hash(name, public_key)
    for line in signatures[:-1].split(b"\n"):
        parts = line.decode("utf-8", "replace").split(" ")
        if len(parts) != 3 or parts[0] != _EM_DASH or parts[1] != name:
            continue
        try:
            signature = base64.b64decode(parts[2], validate=True)
        except (binascii.Error, ValueError):
            continue
        if signature[:4] != wanted:
            continue
        try:
            public_key.verify(signature[4:], text)
        except InvalidSignature:
            raise CheckpointInvalid(
                f"the note's signature by {shown(name)} does not verify",
                check="checkpoint.signature",
            ) from None
        return text
    raise CheckpointInvalid(
        f"the note carries no signature by {shown(name)}", check="checkpoint.signature"
    )
