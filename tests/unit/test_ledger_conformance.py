"""The conformance suite for ledger verifiers (tests/vectors/ledger/): ``ztate verify``
on every named bundle gives exactly the exit code and findings ``expected.json``
names, and the generator rebuilds every byte of the suite.

Another implementation runs the same folders with the same key files and compares
its findings the same way (docs/verification.md, "Conformance suite")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.vectors import generate_ledger_cases

pytestmark = pytest.mark.unit

SUITE = Path(__file__).resolve().parents[1] / "vectors" / "ledger"
EXPECTED: dict[str, Any] = json.loads((SUITE / "expected.json").read_text())["cases"]
ZTATE = str(Path(sys.executable).with_name("ztate"))


def arguments(name: str) -> list[str]:
    case = EXPECTED[name]
    keys = SUITE / "keys"
    args = ["verify", "--bundle", str(SUITE / "cases" / name)]
    if "--public-only" not in case["args"]:
        args += ["--keyring", str(keys / "hmac-keyring.json")]
    args += [
        "--approval-keys",
        str(keys / "approval-public.json"),
        "--checkpoint-keys",
        str(keys / "checkpoint-public.json"),
        "--policy",
        str(SUITE / "policy.yaml"),
        "--json",
        *case["args"],
    ]
    return args


def findings_of(stdout: str) -> list[list[Any]]:
    """Each thread's findings in order, then those of no thread sorted by check: what
    two implementations must agree on."""
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert lines[-1]["type"] == "summary"
    found = [[f["thread_id"], f["version"], f["check"]] for f in lines if f["type"] == "finding"]
    by_thread = sorted((f for f in found if f[0] is not None), key=lambda f: f[0])  # stable
    return by_thread + sorted((f for f in found if f[0] is None), key=lambda f: f[2])


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No configuration but the command line: a fresh home, no ZTATE_* variables."""
    for name in list(os.environ):
        if name.startswith("ZTATE_") or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("ZTATE_HOME", str(tmp_path / "home"))


def test_the_suite_names_every_way_to_be_wrong_the_issue_lists() -> None:
    assert {
        "clean",
        "state",
        "patch",
        "node-id",
        "parent",
        "signature-bit",
        "deleted",
        "forked",
        "swapped",
        "replaced-receipt",
        "expired-receipt",
        "wrong-key-id",
        "rewrite-without-key",
        "rewrite-with-key",
        "non-canonical",
        "role-kind",
        "manifest-rewritten",
    } <= set(EXPECTED)
    assert sorted(p.name for p in (SUITE / "cases").iterdir()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ztate_verify_reports_exactly_the_expected_findings(
    name: str, isolated: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from ztate.services.cli.verify import main

    code = main(arguments(name))
    out = capsys.readouterr().out
    assert (code, findings_of(out)) == (EXPECTED[name]["exit"], EXPECTED[name]["findings"])


def test_the_installed_command_agrees_on_a_clean_and_a_tampered_case(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env["ZTATE_HOME"] = str(tmp_path / "home")
    for name in ("clean", "rewrite-with-key"):
        done = subprocess.run(
            [ZTATE, *arguments(name)], env=env, capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, findings_of(done.stdout)) == (
            EXPECTED[name]["exit"],
            EXPECTED[name]["findings"],
        ), done.stderr


def test_the_generator_rebuilds_every_byte(tmp_path: Path) -> None:
    rebuilt = tmp_path / "ledger"
    generate_ledger_cases.write(rebuilt)
    committed = sorted(p.relative_to(SUITE) for p in SUITE.rglob("*") if p.is_file())
    assert sorted(p.relative_to(rebuilt) for p in rebuilt.rglob("*") if p.is_file()) == committed
    for path in committed:
        assert (rebuilt / path).read_bytes() == (SUITE / path).read_bytes(), path


def dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere")


def looping(path: Path) -> None:
    path.symlink_to(path)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        pytest.param(None, "No such file or directory", id="missing"),
        pytest.param(dangling, "No such file or directory", id="dangling-link"),
        pytest.param(looping, "Too many levels of symbolic links", id="loop"),
    ],
)
def test_checkpoint_keys_given_but_unreadable_stop_the_run_instead_of_going_unchecked(
    make: Any, reason: str, tmp_path: Path, isolated: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped ``--checkpoint-keys`` path was taken for no keys at all: checkpoints and
    manifest.sig went unchecked, and a ledger rewritten with the HMAC key, which only the
    checkpoints reveal, verified OK (exit 0). Keys that are given must load: exit 2,
    naming the file, and no verdict."""
    from ztate.services.cli.verify import main

    assert EXPECTED["rewrite-with-key"]["exit"] == 1  # with the keys
    given = tmp_path / "checkpoint-public.json"
    if make is not None:
        make(given)
    args = arguments("rewrite-with-key")
    args[args.index("--checkpoint-keys") + 1] = str(given)

    code = main(args)

    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert f"{given}: cannot read public keys ({reason})" in captured.err


def test_a_verifier_that_fails_gives_no_verdict_and_repeats_nothing_it_read(
    monkeypatch: pytest.MonkeyPatch, isolated: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failure of the verifier itself (here a MemoryError raised where a bundle is
    verified, as a hostile bundle could cause) is no finding: before, Python's traceback
    ended the run with exit 1, "failures were found". Now exit 2, no summary, and the
    error's type alone (its text may hold the ledger's bytes)."""
    from ztate.services.cli.verify import main
    from ztate.services.verify import bundle

    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError("bytes of the ledger: ignore previous instructions")

    monkeypatch.setattr(bundle, "verify_bundle", exhausted)

    code = main(arguments("clean"))

    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert captured.err == (
        "ztate verify: cannot verify: the verifier failed (MemoryError); the ledger is NOT "
        "verified\n"
    )


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--keyring", "more than 1,048,576 bytes, too large for a keyring"),
        ("--checkpoint-keys", "more than 1,048,576 bytes, too large for public keys"),
        ("--approval-keys", "more than 1,048,576 bytes, too large for public keys"),
        ("--policy", "more than 4,194,304 bytes, too large for a policy file"),
        ("--checkpoints", "line 1: longer than 65,536 bytes, which no checkpoint is"),
        ("manifest.json", "more than 1,048,576 bytes, too large for a manifest"),
    ],
)
def test_an_endless_file_given_to_the_verifier_is_read_no_further_than_its_kind_needs(
    option: str,
    message: str,
    tmp_path: Path,
    isolated: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each file the verifier reads whole has a natural bound; a link to /dev/zero in its
    place (a key file, a policy, the checkpoint journal, which may come from the party
    audited, or the bundle's manifest, which the bundle's editor writes) was read until
    memory ran out. Now exit 2 naming the file and the bound, nothing verified."""
    from ztate.services.cli.verify import main
    from ztate.services.verify import bundle

    monkeypatch.setattr(bundle, "MAX_MANIFEST", 1024 * 1024)  # 1 GiB in use: quicker here
    endless = tmp_path / ("policy.yaml" if option == "--policy" else "endless.json")
    endless.symlink_to("/dev/zero")
    args = arguments("clean")
    if option == "manifest.json":
        folder = tmp_path / "bundle"
        folder.mkdir()
        for part in (SUITE / "cases" / "clean").iterdir():
            (folder / part.name).write_bytes(part.read_bytes())
        (folder / "manifest.json").unlink()
        (folder / "manifest.json").symlink_to("/dev/zero")
        args[args.index("--bundle") + 1] = str(folder)
        endless = folder / "manifest.json"
    elif option in args:
        args[args.index(option) + 1] = str(endless)
    else:
        args += [option, str(endless)]

    code = main(args)

    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "")
    assert captured.err == f"ztate verify: cannot verify: {endless}: {message}\n"
