"""What every ``ztate`` command shares: exit codes, errors, and ``-o json|yaml|table``.

Exit codes (docs/cli.md), the same for every command:

- 0 ``OK``: done (verified, listed, decided, ...).
- 1 ``FAILED``: the command ran and the answer is no: verification found failures, a
  service refused the call (permission, precondition, a stale decision), a probe found
  the service not serving.
- 2 ``USAGE``: the command line or the configuration is wrong (a malformed flag or
  time, unreadable credentials, no such context, an invalid argument the service
  refused as such).
- 3 ``NOT_FOUND``: what was asked for does not exist (a thread, a record, a review).
- 4 ``UNREACHABLE``: the service or database could not be asked (refused connection,
  timeout, TLS handshake failure).
- 130: interrupted (Ctrl-C).

Only standard-library imports here: every command, ``--help`` included, loads this.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

OK, FAILED, USAGE, NOT_FOUND, UNREACHABLE = 0, 1, 2, 3, 4
INTERRUPTED = 130

FORMATS = ("table", "json", "jsonl", "yaml")


class CliError(Exception):
    """A foreseeable failure: one line on stderr and an exit code, never a traceback.
    The message is shown with its unprintable characters escaped (it may quote what a
    service said, which may quote an agent)."""

    def __init__(self, message: str, code: int = FAILED) -> None:
        super().__init__(message)
        self.message = shown(message)
        self.code = code


def shown(text: str) -> str:
    """``text`` for a terminal: every character Python does not call printable (ESC and
    the other controls, C1 controls such as CSI, bidi overrides, line separators)
    written as its escape (``ztate.contract.record.printable``, imported only here, when
    a value is shown)."""
    if text.isprintable():
        return text
    from ztate.contract.record import printable

    return printable(text)


def shown_lines(lines: Iterable[str]) -> str:
    """Lines of a human view (``-o table`` of one resource) joined, each ``shown``: the
    view's own words are printable, so what is escaped is what the server sent (a
    thread id, a node, a key) wherever the view interpolates it."""
    return "\n".join(shown(line) for line in lines)


_NON_ASCII = re.compile("[^\x00-\x7f]")


def _json_escaped(match: re.Match[str]) -> str:
    char = match.group()
    return char if char.isprintable() else json.dumps(char)[1:-1]


def usage(message: str) -> NoReturn:
    raise CliError(message, USAGE)


def rpc_exit_code(code_name: str) -> int:
    """The exit code of a failed gRPC call, by its status code's name."""
    if code_name == "NOT_FOUND":
        return NOT_FOUND
    if code_name in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}:
        return UNREACHABLE
    if code_name == "INVALID_ARGUMENT":
        return USAGE
    return FAILED


def rpc_error(error: Any, target: str | None = None, reason: str | None = None) -> CliError:
    """A ``grpc.aio.AioRpcError`` as a ``CliError`` with the exit code of its status.
    ``reason`` is the ztate reason code (``KEY_NOT_WRITABLE``, ...) when the caller has it."""
    name = error.code().name
    details = error.details() or ""
    if reason is None:
        try:
            from ztate.worker_sdk.errors import from_rpc_error

            reason = from_rpc_error(error).reason
        except Exception:  # a reply without ztate's details: the status code says it
            reason = None
    where = f"{target}: " if target and name in {"UNAVAILABLE", "DEADLINE_EXCEEDED"} else ""
    if name == "UNAVAILABLE":
        details = details.splitlines()[0] if details else "no answer"
        details += " (is the service running? see `ztate context show`)"
    return CliError(f"{where}{reason or name}: {details}", rpc_exit_code(name))


STREAM_FORMATS = (
    "table (default: one line each), json and jsonl (both JSON Lines: one object per line, "
    "as each arrives; a stream has no end to close an array), yaml (one document each)"
)


def add_output_flag(
    parser: argparse.ArgumentParser, *, default: str = "table", stream: bool = False
) -> None:
    """``-o``/``--output`` (and ``--json``, kept for scripts written before ``-o``:
    one compact JSON object per line, as ``-o jsonl``). ``stream``: a command that
    prints as things arrive (``ledger tail``), whose json is JSON Lines."""
    parser.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        default=default,
        help=STREAM_FORMATS
        if stream
        else "table (default, with headers), json (one document: an object, or an array "
        "for lists), jsonl (one object per line), yaml",
    )
    parser.add_argument(
        "--json",
        dest="output",
        action="store_const",
        const="jsonl",
        help="the same as -o jsonl",
    )


Column = tuple[str, Callable[[dict[str, Any]], Any]]


def _cell(value: Any) -> str:
    """One table cell, on one line whatever the value holds (values come from agents:
    an escape sequence or a newline must not draw another row)."""
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return shown(",".join(str(v) for v in value))
    if isinstance(value, dict):
        return dumps(value, indent=None)
    return shown(str(value))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Rows under upper-case column headers, left-aligned, two spaces apart."""
    cells = [[name.upper() for name, _ in columns]]
    cells += [[_cell(get(row)) for _, get in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def dumps(value: Any, *, indent: int | None = 2) -> str:
    """JSON, non-ASCII text kept readable but for the characters a terminal would act on
    or reorder (C1 controls, bidi overrides, separators: ``\\uXXXX`` escapes, as JSON
    already writes the C0 controls)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, indent=indent)
    return text if text.isascii() else _NON_ASCII.sub(_json_escaped, text)


def yaml_text(value: Any) -> str:
    """YAML, non-ASCII text kept readable unless the document holds a character a
    terminal would act on or reorder: then every non-ASCII character is escaped."""
    import yaml

    text: str = yaml.safe_dump(value, sort_keys=True, allow_unicode=True, default_flow_style=False)
    if not text.isascii() and not all(c.isprintable() for c in _NON_ASCII.findall(text)):
        text = yaml.safe_dump(value, sort_keys=True, allow_unicode=False, default_flow_style=False)
    return text


def emit_list(
    rows: Iterable[dict[str, Any]],
    output: str,
    columns: Sequence[Column],
    *,
    empty: str = "nothing matches",
) -> None:
    """Print a list of one kind of resource in the chosen format."""
    found = list(rows)
    if output == "json":
        write(dumps(found))
    elif output == "jsonl":
        for row in found:
            write(dumps(row, indent=None))
    elif output == "yaml":
        write(yaml_text(found).rstrip("\n"))
    elif found:
        write(table(found, columns))
    else:
        print(empty, file=sys.stderr)


def emit_one(resource: dict[str, Any], output: str, text: Callable[[dict[str, Any]], str]) -> None:
    """Print one resource: ``text`` renders it for people (``-o table``)."""
    if output == "json":
        write(dumps(resource))
    elif output == "jsonl":
        write(dumps(resource, indent=None))
    elif output == "yaml":
        write(yaml_text(resource).rstrip("\n"))
    else:
        write(text(resource))


def write(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def set_log_level(name: str) -> None:
    """Show log lines from ``name`` (``info``, ``warning``, ...) up, on every handler."""
    import logging

    logging.getLogger().setLevel(name.upper())
