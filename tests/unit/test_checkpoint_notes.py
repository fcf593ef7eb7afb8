"""Checkpoints as C2SP signed notes (ztate.contract.checkpoints): the envelope
transparency-log tooling verifies. Anchored to the known answers of other
implementations: the Go reference (golang.org/x/mod/sumdb/note documentation) and the
signed-note specification's own example, used as data."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ztate.contract.checkpoints import (
    note_key_hash,
    note_text,
    note_verifier_key,
    sign_checkpoint,
    sign_note,
    verify_checkpoint,
    verify_note,
)
from ztate.contract.errors import CheckpointInvalid

pytestmark = pytest.mark.unit

GO_SIGNER = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VERIFIER = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_TEXT = (
    b"If you think cryptography is the answer to your problem,\n"
    b"then you don't know what your problem is.\n"
)
GO_NOTE = (
    GO_TEXT
    + (
        "\n\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFY"
        "C2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
    ).encode()
)
SPEC_VERIFIER = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
SPEC_NOTE = (
    "This is an example message.\n\n\u2014 example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6T"
    "fXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n"
).encode()


def go_key() -> Ed25519PrivateKey:
    seed = base64.b64decode(GO_SIGNER.split("+", 4)[4])
    assert seed[0] == 1  # Ed25519
    return Ed25519PrivateKey.from_private_bytes(seed[1:])


def public_of(verifier_key: str) -> tuple[str, Ed25519PublicKey]:
    name, _, encoded = verifier_key.split("+", 2)
    raw = base64.b64decode(encoded)
    return name, Ed25519PublicKey.from_public_bytes(raw[1:])


def test_signing_reproduces_the_go_reference_note_byte_for_byte() -> None:
    key = go_key()
    assert note_verifier_key("PeterNeumann", key.public_key()) == GO_VERIFIER
    assert note_key_hash("PeterNeumann", key.public_key()).hex() == "c74f20a3"
    assert sign_note(GO_TEXT, "PeterNeumann", key) == GO_NOTE


@pytest.mark.parametrize(("verifier", "note"), [(GO_VERIFIER, GO_NOTE), (SPEC_VERIFIER, SPEC_NOTE)])
def test_notes_of_other_implementations_verify(verifier: str, note: bytes) -> None:
    name, public = public_of(verifier)
    assert note_verifier_key(name, public) == verifier
    assert verify_note(note, name, public) == note.rpartition(b"\n\n")[0] + b"\n"


def test_a_changed_text_or_another_key_does_not_verify() -> None:
    name, public = public_of(GO_VERIFIER)
    with pytest.raises(CheckpointInvalid, match="does not verify"):
        verify_note(GO_NOTE.replace(b"problem", b"Problem", 1), name, public)
    other = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32).public_key()
    with pytest.raises(CheckpointInvalid, match="no signature by PeterNeumann"):
        verify_note(GO_NOTE, name, other)
    with pytest.raises(CheckpointInvalid, match="not a signed note"):
        verify_note(GO_TEXT, name, public)


def test_a_checkpoint_as_a_note_is_shaped_like_a_tlog_checkpoint() -> None:
    key = Ed25519PrivateKey.from_private_bytes(b"\x02" * 32)
    signed = sign_checkpoint(
        key,
        "checkpoint-k1",
        thread_id="order-42",
        version=6,
        head_digest="ab" * 32,
        signed_at=datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
    )
    body = verify_checkpoint(signed, {"checkpoint-k1": key.public_key()})
    text = note_text(body, "ztate.example")
    digest = base64.b64encode(bytes.fromhex("ab" * 32)).decode()
    assert text == f"ztate.example/ztate/thread/order-42\n7\n{digest}\n".encode()
    note = sign_note(text, "ztate.example", key)
    assert verify_note(note, "ztate.example", key.public_key()) == text
    with pytest.raises(ValueError, match="without spaces"):
        note_text(body, "two words")
