"""docs/cli.md against the parser: its Commands table names every ``ztate`` command the
parser has (the installed services' too), and nothing the parser lacks."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ztate.services.cli.main import build_parser

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[str]:
    """Every runnable command, as ``"ledger list"``."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return {" ".join(path)}
    found: set[str] = set()
    for group in groups:
        for name, child in group.choices.items():
            found |= commands(child, (*path, name))
    return found


def documented() -> set[str]:
    """The commands of the Commands table: each row's first cell, ``ztate`` and the
    words before its first argument or flag (``ztate context list\\|show`` is two)."""
    text = CLI_MD.read_text(encoding="utf-8")
    assert "\n## Commands\n" in text, "docs/cli.md has no Commands section"
    table = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    found: set[str] = set()
    for row in re.findall(r"^\| `ztate ([^`]+)` \|", table, re.MULTILINE):
        words = []
        for word in row.split():
            if not re.fullmatch(r"[a-z][a-z-]*(\\\|[a-z][a-z-]*)*", word):
                break
            words.append(word)
        *group, last = words
        found |= {" ".join((*group, choice)) for choice in last.split("\\|")}
    return found


def test_every_command_is_in_the_docs_and_no_other() -> None:
    parsed = commands(build_parser())
    listed = documented()
    assert sorted(parsed - listed) == [], "commands missing from docs/cli.md's Commands table"
    assert sorted(listed - parsed) == [], "docs/cli.md names commands the parser lacks"


def test_ledger_tail_says_its_json_is_json_lines() -> None:
    """``ledger tail -o json`` writes one object per line (a stream has no end to close
    an array), while its help said "one document"."""
    import subprocess
    import sys
    from pathlib import Path

    ztate = str(Path(sys.executable).with_name("ztate"))
    done = subprocess.run(
        [ztate, "ledger", "tail", "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join(done.stdout.split())
    assert "json and jsonl (both JSON Lines: one object per line" in text
    assert "one document: an object" not in text
