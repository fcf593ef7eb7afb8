"""The revocation list: its format (docs/operations.md), what ``ztate ca revoke`` writes,
and what a service's check refuses."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ztate.services.cli import ca
from ztate.services.cli.main import main as ztate
from ztate.services.runtime.errors import IdentityRevoked
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.revocation import (
    FORMAT,
    RevocationList,
    RevocationListError,
    Revocations,
    parse_serial,
)

PLANNER = "spiffe://ztate.test/node/planner"


def document(*entries: object) -> bytes:
    return json.dumps({"format": FORMAT, "revoked": list(entries)}).encode()


def test_the_cli_writes_the_documented_format(tmp_path: Path) -> None:
    ca.init_ca(tmp_path / "ca", "ztate.test")
    issued = ca.issue(tmp_path / "ca", Identity("ztate.test", Role.NODE, "planner"), tmp_path)
    listed = tmp_path / "list" / "revocations.json"
    assert ztate(["ca", "revoke", "--cert", str(issued.cert), "--list", str(listed),
                  "--note", "laptop lost"]) == 0  # fmt: skip
    assert ztate(["ca", "revoke", "--spiffe-id", PLANNER, "--list", str(listed)]) == 0
    assert ztate(["ca", "revoke", "--serial", "0A:0B", "--list", str(listed)]) == 0
    assert ztate(["ca", "revoke", "--serial", "a0b", "--list", str(listed)]) == 0  # no twice
    written = json.loads(listed.read_bytes())
    serial = format(ca.Issued.read(issued.cert).serial, "x")
    assert written["format"] == "ztate-revocations/1"
    assert [{k: v for k, v in e.items() if k != "revoked_at"} for e in written["revoked"]] == [
        {"serial": serial, "note": "laptop lost"},
        {"spiffe_id": PLANNER},
        {"serial": "a0b"},
    ]
    assert all(e["revoked_at"].endswith("Z") for e in written["revoked"])
    assert stat.S_IMODE(listed.stat().st_mode) == 0o644
    assert [p.name for p in listed.parent.iterdir()] == ["revocations.json"]  # no leftovers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--serial", "zz"], "'zz' is not a hexadecimal certificate serial"),
        (["--spiffe-id", "node/planner"], "'node/planner' is not a SPIFFE ID"),
        # spelled otherwise than a certificate's: it would match no caller, revoke nothing
        ([f"--spiffe-id={PLANNER}/"], f"{PLANNER + '/'!r} is not a SPIFFE ID"),
        (["--spiffe-id=spiffe://ztate.test/node/Planner"], "node/Planner' is not a SPIFFE ID"),
        ([f"--spiffe-id={PLANNER} "], f"{PLANNER + ' '!r} is not a SPIFFE ID"),
        (["--spiffe-id=spiffe://ztate.test/agent/planner"], "is not a SPIFFE ID"),
        (["--serial", "ab", "--note", "x" * 300], "revoked_at is a time and note a short text"),
    ],
)
def test_the_cli_refuses_what_it_cannot_revoke_and_writes_nothing(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = tmp_path / "revocations.json"
    assert ztate(["ca", "revoke", *argv, "--list", str(listed)]) == 1
    assert message in capsys.readouterr().err
    assert not listed.exists()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"[", "not JSON"),
        (b'{"format": "other/1", "revoked": []}', "not a ztate-revocations/1 document"),
        (json.dumps({"format": FORMAT}).encode(), "holds format and a list revoked"),
        (document({"serial": "ab", "spiffe_id": PLANNER, "revoked_at": "t"}), "exactly one"),
        (document({"revoked_at": "t"}), "exactly one"),
        (document({"serial": "AB", "revoked_at": "t"}), "lower-case hexadecimal"),
        (document({"spiffe_id": "planner", "revoked_at": "t"}), "must be a SPIFFE ID"),
        (document({"spiffe_id": 7, "revoked_at": "t"}), "must be a SPIFFE ID"),
        (document({"serial": "ab"}), "revoked_at is a time"),
        (document({"serial": "ab", "revoked_at": "t", "by": "me"}), "an entry is an object"),
    ],
)
def test_a_malformed_list_is_refused_with_where(data: bytes, message: str) -> None:
    with pytest.raises(RevocationListError, match=message):
        RevocationList.parse(data, "list.json")


def test_a_serial_or_an_identity_is_refused() -> None:
    revoked = RevocationList.parse(
        document({"serial": "a0b", "revoked_at": "t"}, {"spiffe_id": PLANNER, "revoked_at": "t"})
    )
    with pytest.raises(IdentityRevoked, match=f"^identity {PLANNER} is revoked$"):
        revoked.check(PLANNER, 1)
    other = "spiffe://ztate.test/node/db-writer"
    with pytest.raises(IdentityRevoked, match=f"^certificate a0b of {other} is revoked$"):
        revoked.check(other, 0xA0B)
    revoked.check(other, 0xA0C)
    revoked.check(other, None)


def test_serials_are_read_as_people_copy_them() -> None:
    assert parse_serial("serial=0A:0B") == parse_serial("0x0a0b") == parse_serial("A0B") == 0xA0B


def test_a_service_starts_without_a_list_and_refuses_on_a_broken_one(tmp_path: Path) -> None:
    path = tmp_path / "revocations.json"
    Revocations(path).check(PLANNER, 1)  # nothing revoked
    path.write_bytes(b"{")
    with pytest.raises(RevocationListError, match="not JSON"):
        Revocations(path)


def test_a_list_removed_while_it_is_read_again_forgives_no_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list changes, and is removed just as the service opens it to read it again
    (an operator's ``rm``, a config map swapped). Before, the service had checked that
    the file existed, then read a missing file as an empty list: every revoked identity
    was accepted until the file came back. The last list read stays."""
    path = tmp_path / "revocations.json"
    path.write_bytes(document({"spiffe_id": PLANNER, "revoked_at": "2026-11-26T00:00:00Z"}))
    revocations = Revocations(path)
    with pytest.raises(IdentityRevoked):
        revocations.check(PLANNER, 1)
    path.write_bytes(document({"serial": "0A", "revoked_at": "2026-11-26T00:00:01Z"}) + b" ")
    read = Path.read_bytes

    def removed_as_opened(self: Path) -> bytes:
        if self == path:
            path.unlink()
        return read(self)

    monkeypatch.setattr(Path, "read_bytes", removed_as_opened)
    with pytest.raises(IdentityRevoked, match=f"identity {PLANNER} is revoked"):
        revocations.check(PLANNER, 1)
    monkeypatch.undo()
    with pytest.raises(IdentityRevoked):  # still gone: still the last list
        revocations.check(PLANNER, 1)


def test_revocations_run_at_once_all_land(tmp_path: Path) -> None:
    """``ztate ca revoke`` run by several operators (or a script) at once: every entry
    each reported as revoked is in the list (each run locks it while it reads, adds and
    writes; before, the last rename dropped the others' entries)."""
    listed = tmp_path / "revocations.json"
    runs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "ztate.services.cli.main", "ca", "revoke"),
                *("--serial", format(0x1000 + i, "x"), "--list", str(listed)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(8)
    ]
    said = [run.communicate(timeout=60) for run in runs]
    assert [run.returncode for run in runs] == [0] * 8, said
    kept = {entry.serial for entry in RevocationList.load(listed).entries}
    assert kept == {0x1000 + i for i in range(8)}


def test_an_entry_spelled_otherwise_than_a_certificate_loads_and_says_it_revokes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A list an older ``ztate ca revoke`` wrote, or a hand edit, may hold an identity
    no certificate carries (a trailing slash, a capital): it never matched a caller.
    The list loads with the valid entries beside it, and the log names the entry."""
    listed = RevocationList.parse(
        document(
            {"spiffe_id": PLANNER + "/", "revoked_at": "t"},
            {"spiffe_id": "spiffe://ztate.test/node/db-writer", "revoked_at": "t"},
        ),
        "list.json",
    )
    with pytest.raises(IdentityRevoked):
        listed.check("spiffe://ztate.test/node/db-writer", None)
    listed.check(PLANNER, None)  # not revoked: the entry never named it
    assert [r.getMessage() for r in caplog.records] == [
        f"list.json, entry 0 revokes nothing: {PLANNER + '/'!r} is not a SPIFFE ID "
        "spiffe://<trust domain>/<role>/<name> as certificates carry it"
    ]
