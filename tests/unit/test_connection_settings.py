"""Where a client command's connection comes from (services/cli/context.py ``resolve``):
an environment variable is held to the rule of settings (no control character, at most
4096 characters) only when its value is used, and an error names the variable the value
came from. The real CLI in this process; stderr compared line by line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ztate.services.cli.context import CLIENT_HINT
from ztate.services.cli.main import main

CONNECTION_ENV = ("ZTATE_ADDRESS", "ZTATE_CERT", "ZTATE_KEY", "ZTATE_CA", "ZTATE_SERVER_NAME",
                  "ZTATE_CONTEXT", "ZTATE_CONFIG", "XDG_CONFIG_HOME", "ZTATE_LISTEN")  # fmt: skip


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CONNECTION_ENV:
        monkeypatch.delenv(name, raising=False)


def said(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, err.splitlines(), out


def test_ztate_home_is_not_read_when_flags_give_every_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Certificate, key and CA all given: ZTATE_HOME is never used, so a value of it
    that breaks the rule is no error; the command goes on to the files it was given."""
    monkeypatch.setenv("ZTATE_HOME", "/srv/\x1b[31mztate")
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    cert = tmp_path / "me.crt"
    flags = ["--client-cert", str(cert), "--client-key", str(tmp_path / "me.key"),
             "--ca-cert", str(tmp_path / "ca.crt"), "--address", "127.0.0.1:1"]  # fmt: skip
    assert said(["ledger", "list", *flags], capsys) == (
        2,
        [f"ztate: cannot read credentials: {cert}: No such file or directory {CLIENT_HINT}"],
        "",
    )


def test_ztate_home_is_held_to_the_rule_when_a_default_file_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --ca-cert the CA is $ZTATE_HOME/certs/ca.crt: ZTATE_HOME is read, and
    refused, the value never printed."""
    monkeypatch.setenv("ZTATE_HOME", "/srv/\x1b[31mztate")
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    flags = ["--client-cert", str(tmp_path / "me.crt"), "--client-key",
             str(tmp_path / "me.key"), "--address", "127.0.0.1:1"]  # fmt: skip
    assert said(["ledger", "list", *flags], capsys) == (
        2,
        ["ztate: ZTATE_HOME: control characters are not allowed"],
        "",
    )


def test_without_xdg_config_home_a_hostile_home_is_named_home(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ZTATE_CONFIG, no XDG_CONFIG_HOME: the context file is under $HOME/.config, and
    a HOME that breaks the rule is said to be HOME's, not a variable never set."""
    monkeypatch.setenv("HOME", "/home/a\nztate: all is well")
    assert said(["context", "show"], capsys) == (
        2,
        ["ztate: HOME: control characters are not allowed"],
        "",
    )
