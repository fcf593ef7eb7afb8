"""`ztate policy check` and `ztate policy show`, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ztate.services.policy.model import Policy

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "services" / "defaults" / "policy.yaml"
ZTATE = str(Path(sys.executable).with_name("ztate"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ZTATE, *args], capture_output=True, text=True, timeout=60, check=False)


def test_check_accepts_a_valid_policy_and_prints_its_digest() -> None:
    result = run("policy", "check", str(DEFAULT))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pipeline: valid, digest {Policy.load(DEFAULT).digest}"


def test_check_refuses_a_bad_policy_with_every_problem_and_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "format: 1\nname: bad\nkeys:\n  a: {layer: core, type: string}\n"
        "nodes:\n  n: {layer: working, write: [a, zz]}\n"
    )
    result = run("policy", "check", str(bad))
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"{bad}:6: nodes.n.write.1: undeclared key 'zz'" in result.stderr
    assert f"{bad}:6: nodes.n.write.0: grants write access to core key 'a'" in result.stderr


def test_show_prints_the_effective_policy_with_defaults_filled_in() -> None:
    result = run("policy", "show", str(DEFAULT))
    assert result.returncode == 0, result.stderr
    header, _, body = result.stdout.partition("\n")
    assert header == f"# policy pipeline, digest {Policy.load(DEFAULT).digest}"
    shown = json.loads(body)
    assert shown["keys"]["raw_text"]["max_length"] == 8000
    assert shown["keys"]["result_ref"]["min_length"] == 0  # a default, filled in
    assert shown["nodes"]["input-parser"]["max_patch_bytes"] == 4096
    assert shown["nodes"]["input-parser"]["read_records"] is False  # a default, filled in
    assert shown["nodes"]["db-writer"]["read_records"] is True


def test_show_and_check_print_one_json_shape() -> None:
    shown = run("policy", "show", str(DEFAULT), "-o", "json")
    assert shown.returncode == 0, shown.stderr
    [policy] = json.loads(shown.stdout)
    assert (policy["name"], policy["digest"]) == ("pipeline", Policy.load(DEFAULT).digest)
    assert policy["document"]["nodes"]["db-writer"]["read_records"] is True
    checked = run("policy", "check", str(DEFAULT), "-o", "json")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout) == [
        {"name": "pipeline", "digest": policy["digest"], "valid": True}
    ]


def test_check_escapes_what_the_policy_file_holds(tmp_path: Path) -> None:
    """A policy key holding an escape was echoed raw in the error ("Error messages are
    escaped the same way", docs/cli.md)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        'format: 1\nname: bad\nkeys:\n  "bad\\e]0;TITLE\\a\\u202e": {layer: core, type: nope}\n'
        "nodes: {}\n"
    )
    result = run("policy", "check", str(bad))
    assert (result.returncode, result.stdout) == (1, "")
    assert "Traceback" not in result.stderr
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in result.stderr
    assert "bad\\x1b]0;TITLE\\x07\\u202e" in result.stderr


def test_check_of_a_deeply_nested_file_is_an_invalid_policy(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("keys: " + "[" * 5000 + "]" * 5000 + "\n")
    result = run("policy", "check", str(deep))
    assert (result.returncode, result.stdout, result.stderr) == (
        1,
        "",
        f"ztate: invalid policy:\n{deep}: nested too deeply\n",
    )


def test_health_timeout_is_bounded() -> None:
    """``--timeout inf`` (nan, 1e308, -1) made a serving service look unreachable."""
    for timeout in ("inf", "nan", "1e308", "-1", "0"):
        result = run("health", "--timeout", timeout)
        assert (result.returncode, result.stdout) == (2, ""), timeout
        assert result.stderr.splitlines()[-1] == (
            "ztate health: error: argument --timeout: must be 0.1 to 3600"
        )
