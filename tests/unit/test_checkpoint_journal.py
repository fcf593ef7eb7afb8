"""The checkpoint signer's journal and the checkpoint-line format it shares with bundles:
what it remembers, what it refuses, and a hostile ``ztate verify --checkpoints`` file."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.checkpoints import (
    SignedCheckpoint,
    checkpoint_line,
    parse_checkpoint_line,
    sign_checkpoint,
    verify_note,
)
from ztate.contract.errors import CheckpointInvalid
from ztate.contract.keyring import generate_signing_key
from ztate.services.cli.verify import main as verify_main
from ztate.transition_service.journal import (
    CheckpointJournal,
    JournalError,
    NotePublisher,
    SignedHead,
)

REPO = Path(__file__).resolve().parents[2]
KEY = Ed25519PrivateKey.generate()
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def signed(thread_id: str, version: int, digest: str) -> SignedCheckpoint:
    return sign_checkpoint(
        KEY, "ck1", thread_id=thread_id, version=version, head_digest=digest, signed_at=NOW
    )


def test_a_line_round_trips_and_keeps_untext_bytes_as_base64() -> None:
    honest = signed("t-1", 3, "a" * 64)
    assert parse_checkpoint_line(checkpoint_line("t-1", 3, honest)) == ("t-1", 3, honest)
    tampered = SignedCheckpoint(b"\xff\xfe", "00", "ck1")
    line = checkpoint_line("t-1", 3, tampered)
    assert b'"base64"' in line
    assert parse_checkpoint_line(line)[2] == tampered


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"{not json", "not JSON"),
        (b"[1]", "exactly the members"),
        (b'{"thread_id":1,"version":1,"checkpoint":"x","signature":"s","key_id":"k"}', "thread_id"),
        (
            b'{"thread_id":"t","version":"1","checkpoint":"x","signature":"s","key_id":"k"}',
            "version",
        ),
        (
            b'{"thread_id":"t","version":1,"checkpoint":{"base64":"%%"},"signature":"s","key_id":"k"}',
            "base64",
        ),
        (b'{"thread_id":"t","version":1,"checkpoint":null,"signature":"s","key_id":"k"}', "text"),
    ],
)
def test_a_line_that_is_not_a_checkpoint_line_is_refused(line: bytes, says: str) -> None:
    with pytest.raises(CheckpointInvalid, match=says) as refused:
        parse_checkpoint_line(line)
    assert refused.value.check == "checkpoint.line"


def test_the_journal_remembers_the_newest_head_and_reads_other_replicas_appends(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.jsonl"
    mine, theirs = CheckpointJournal(path), CheckpointJournal(path)
    mine.append([("t-1", 1, signed("t-1", 1, "a" * 64)), ("t-2", 4, signed("t-2", 4, "b" * 64))])
    assert mine.last_signed("t-1") == SignedHead(1, "a" * 64)
    theirs.append([("t-1", 2, signed("t-1", 2, "c" * 64))])
    mine.refresh()
    assert mine.last_signed("t-1") == SignedHead(2, "c" * 64)
    assert mine.last_signed("t-2") == SignedHead(4, "b" * 64)
    assert mine.last_signed("t-3") is None
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_cut_last_line_waits_and_a_foreign_line_stops_the_signer(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = CheckpointJournal(path)
    journal.append([("t-1", 1, signed("t-1", 1, "a" * 64))])
    whole = checkpoint_line("t-1", 2, signed("t-1", 2, "b" * 64))
    with path.open("ab") as handle:
        handle.write(whole[:20])  # a crash mid-write
    journal.refresh()
    assert journal.last_signed("t-1") == SignedHead(1, "a" * 64)
    with path.open("ab") as handle:
        handle.write(whole[20:])
    journal.refresh()
    assert journal.last_signed("t-1") == SignedHead(2, "b" * 64)
    # a line whose signed content names another version than the line claims
    lying = checkpoint_line("t-1", 9, signed("t-1", 3, "d" * 64))
    with path.open("ab") as handle:
        handle.write(lying)
    with pytest.raises(JournalError, match="signs another thread or version"):
        journal.refresh()
    assert journal.last_signed("t-1") == SignedHead(2, "b" * 64)  # memory unchanged


@pytest.mark.parametrize(
    "content",
    [b"{not json\n", b'{"a":1}\n', b"\xff\xfe\n", b"[" * 100_000 + b"\n"],
    ids=["not-json", "not-a-line", "not-utf8", "deep"],
)
def test_a_hostile_checkpoints_file_is_a_usage_error_never_a_crash(
    content: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    public = tmp_path / "public.json"
    generate_signing_key(tmp_path / "signing.pem", public, "ck1")
    hostile = tmp_path / "kept.jsonl"
    hostile.write_bytes(content)
    monkeypatch.setenv("ZTATE_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    code = verify_main(
        [
            "verify",
            "--public-only",
            "--checkpoint-keys",
            str(public),
            "--checkpoints",
            str(hostile),
            "--policy",
            str(REPO / "services" / "defaults" / "policy.yaml"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"{hostile}: line 1: " in err
    assert "Traceback" not in err


def test_notes_keep_the_latest_head_per_thread_and_never_follow_a_forged_id(
    tmp_path: Path,
) -> None:
    """A head row comes from the database, which the signer does not trust: a thread id
    that is not one ("../escaped", "a/b") names no file; an honest thread keeps only
    its latest checkpoint's note."""
    notes = NotePublisher(tmp_path / "notes", "ztate.test")
    notes.publish(
        [
            signed("t-1", 1, "a" * 64),
            signed("t-1", 2, "b" * 64),
            signed("../escaped", 1, "c" * 64),
            signed("a/b", 1, "d" * 64),
        ],
        KEY,
    )
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["thread-t-1.note"]
    text = verify_note(
        (tmp_path / "notes" / "thread-t-1.note").read_bytes(), "ztate.test", KEY.public_key()
    )
    assert text.startswith(b"ztate.test/ztate/thread/t-1\n3\n")
