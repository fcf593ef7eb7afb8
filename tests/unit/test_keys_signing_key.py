"""``ztate keys signing-key``: an Ed25519 key for receipts or checkpoints whose
public half joins a public keyring; rotation keeps old public keys; nothing is
overwritten and no key material reaches the terminal."""

from __future__ import annotations

import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ztate.contract.checkpoints import sign_checkpoint, verify_checkpoint
from ztate.contract.keyring import load_public_keys, load_signing_key
from ztate.services.cli.main import main


def _sign_and_verify(private: Path, public: Path, key_id: str) -> None:
    signed = sign_checkpoint(
        load_signing_key(private),
        key_id,
        thread_id="t-1",
        version=3,
        head_digest="0" * 64,
        signed_at=datetime.now(UTC),
    )
    assert verify_checkpoint(signed, load_public_keys(public))["version"] == 3


def test_a_new_key_signs_what_its_public_keyring_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    private, public = tmp_path / "k1.pem", tmp_path / "public.json"
    assert main(["keys", "signing-key", "--private", str(private), "--public", str(public),
                 "--key-id", "checkpoint-k1"]) == 0  # fmt: skip
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    _sign_and_verify(private, public, "checkpoint-k1")
    out = capsys.readouterr()
    assert "PRIVATE KEY" not in out.out + out.err
    assert public.read_text().split('"')[3] not in out.out + out.err  # no public key bytes


def test_rotating_adds_a_key_and_keeps_the_old_one(tmp_path: Path) -> None:
    public = tmp_path / "public.json"
    for key_id in ("a-k1", "a-k2"):
        private = tmp_path / f"{key_id}.pem"
        assert main(["keys", "signing-key", "--private", str(private), "--public", str(public),
                     "--key-id", key_id]) == 0  # fmt: skip
    assert sorted(load_public_keys(public)) == ["a-k1", "a-k2"]
    _sign_and_verify(tmp_path / "a-k1.pem", public, "a-k1")
    _sign_and_verify(tmp_path / "a-k2.pem", public, "a-k2")


@pytest.mark.parametrize("problem", ["private exists", "key id taken", "bad key id", "bad keyring"])
def test_refusals_change_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str
) -> None:
    private, public = tmp_path / "new.pem", tmp_path / "public.json"
    main(["keys", "signing-key", "--private", str(tmp_path / "old.pem"), "--public", str(public),
          "--key-id", "k1"])  # fmt: skip
    capsys.readouterr()
    key_id, expected = "k2", ""
    if problem == "private exists":
        private.write_bytes(b"keep me")
        expected = "exists; a signing key is never overwritten"
    elif problem == "key id taken":
        key_id, expected = "k1", "already holds key id 'k1'"
    elif problem == "bad key id":
        key_id, expected = "k 2", "key id must be 1-64 characters"
    else:
        public.write_text("{not json")
        expected = str(public)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code = main(["keys", "signing-key", "--private", str(private), "--public", str(public),
                 "--key-id", key_id])  # fmt: skip
    assert code == 1
    assert expected in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
