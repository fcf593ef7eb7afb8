"""``ztate keys rotate``: a new current key, old keys kept, the file replaced
atomically with mode 0600, and no key material on the terminal."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from ztate.contract.keyring import Keyring, generate_keyring_file
from ztate.services.cli.main import main


def _keys(path: Path) -> dict[str, str]:
    keys: dict[str, str] = json.loads(path.read_text())["keys"]
    return keys


def test_rotate_adds_a_current_key_and_keeps_the_old(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ring.json"
    generate_keyring_file(path, "k1")
    old = Keyring.load(path, None)

    assert main(["keys", "rotate", "--file", str(path)]) == 0

    rotated = Keyring.load(path, None)
    assert rotated.current == "k2"
    assert rotated.key_ids == ("k1", "k2")
    assert rotated.key("k1") == old.key("k1")
    assert len(rotated.key("k2")) == 32
    assert rotated.key("k2") != old.key("k1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ring.json"]  # no temp file left
    out = capsys.readouterr()
    assert out.out == (
        f"added key 'k2' to {path} and made it current (mode 0600)\n"
        "restart the transition service to sign new records under it\n"
    )
    for material in _keys(path).values():
        assert material not in out.out + out.err


def test_rotate_with_a_chosen_key_id(tmp_path: Path) -> None:
    path = tmp_path / "ring.json"
    generate_keyring_file(path, "k1")
    assert main(["keys", "rotate", "--file", str(path), "--key-id", "2026-11"]) == 0
    assert main(["keys", "rotate", "--file", str(path)]) == 0
    rotated = Keyring.load(path, None)
    assert rotated.key_ids == ("2026-11", "k1", "k3")
    assert rotated.current == "k3"


@pytest.mark.parametrize(
    ("key_id", "message"),
    [
        ("k1", "key id 'k1' already exists; key ids are never reused"),
        ("bad id!", "key id 'bad id!' must be 1-64 characters of [A-Za-z0-9._-]"),
    ],
)
def test_rotate_refuses_a_reused_or_malformed_id_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key_id: str, message: str
) -> None:
    path = tmp_path / "ring.json"
    generate_keyring_file(path, "k1")
    before = path.read_bytes()
    assert main(["keys", "rotate", "--file", str(path), "--key-id", key_id]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ring.json"]


def test_rotate_of_a_missing_keyring_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "absent.json"
    assert main(["keys", "rotate", "--file", str(path)]) == 1
    assert capsys.readouterr().err == (
        f"ztate: {path}: cannot read the keyring (No such file or directory)\n"
    )
    assert not path.exists()
