"""The HMAC keyring: strict loading, and key material never shown."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest

from ztate.contract.errors import KeyringError
from ztate.contract.keyring import Keyring, generate_keyring_file, rotate_keyring_file

KEY = base64.b64encode(b"k" * 32).decode()


def doc(**overrides: object) -> str:
    return json.dumps({"current": "k1", "keys": {"k1": KEY}, **overrides})


def test_loads_and_hides_material() -> None:
    ring = Keyring.from_json(doc(), source="env")
    assert ring.key("k1") == b"k" * 32
    assert ring.key_ids == ("k1",)
    assert KEY not in repr(ring)
    assert "kkkk" not in repr(ring)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("not json", "not JSON"),
        (json.dumps({"keys": {"k1": KEY}}), "exactly the members"),
        (doc(current="k2"), "current key id 'k2' is not in the keyring"),
        (doc(keys={}), "non-empty"),
        (doc(keys={"k1": "%%%"}), "not valid base64"),
        (doc(keys={"k1": base64.b64encode(b"short").decode()}), "shorter than 32 bytes"),
        (doc(keys={"bad id!": KEY}, current="bad id!"), "must be 1-64 characters"),
    ],
)
def test_refuses_bad_documents_without_echoing_keys(text: str, fragment: str) -> None:
    with pytest.raises(KeyringError) as caught:
        Keyring.from_json(text, source="ZTATE_HMAC_KEYRING")
    assert fragment in str(caught.value)
    assert KEY not in str(caught.value)


def test_environment_wins_over_file(tmp_path: Path) -> None:
    path = tmp_path / "ring.json"
    generate_keyring_file(path, "file-key")
    assert Keyring.load(path, None).current == "file-key"
    assert Keyring.load(path, doc()).current == "k1"


def test_generated_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "ring.json"
    generate_keyring_file(path)
    assert path.stat().st_mode & 0o077 == 0
    with pytest.raises(FileExistsError):
        generate_keyring_file(path)


@pytest.mark.parametrize(("before", "after"), [(0o600, 0o600), (0o640, 0o640), (0o644, 0o640)])
def test_rotation_keeps_the_keyrings_permissions_less_any_for_others(
    tmp_path: Path, before: int, after: int
) -> None:
    """A rotation wrote its new keyring 0600 whatever the old one was: a keyring the
    service read through its group (a Kubernetes Secret's 0440 with fsGroup, a shared
    group on a host) became unreadable to it. It keeps the permissions now, less any
    for others, and the owner and group."""
    path = tmp_path / "keyring.json"
    generate_keyring_file(path)
    path.chmod(before)
    old = path.stat()
    new_id = rotate_keyring_file(path)
    rotated = path.stat()
    assert stat.S_IMODE(rotated.st_mode) == after
    assert (rotated.st_uid, rotated.st_gid) == (old.st_uid, old.st_gid)
    assert Keyring.load(path, None).current == new_id


def test_rotation_reads_the_keyring_as_the_service_does(tmp_path: Path) -> None:
    """A path to /dev/zero (or any file past 1 MiB) was read whole by a rotation."""
    path = tmp_path / "keyring.json"
    path.write_bytes(b" " * (2 * 1024 * 1024))
    with pytest.raises(KeyringError, match="more than 1,048,576 bytes, too large for a keyring"):
        rotate_keyring_file(path)
    assert path.stat().st_size == 2 * 1024 * 1024  # unchanged
