"""The ``ztate`` command: argparse, one module per command group, imports on demand.

Start-up matters (``ztate --help`` and the containers' exec probe run it often), so
this module and every ``register`` function import only the standard library and
argparse; a command imports gRPC, asyncpg, the policy engine and the rest when it
runs. ``tests/unit/test_cli_startup.py`` holds that line.

Commands come from ``COMMANDS`` (each a module's ``register(commands)``) and from
the installed services' ``ztate.cli`` entry points (``run``, ``serve``,
``approval-serve``, ``approvals``). A module that adds to an existing group
(``threads``, ``ledger``) gets it with ``group(commands, name, help)``.

Failures are ``CliError``s (services/cli/output.py): one line on stderr, the
documented exit code (docs/cli.md), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ztate.services.cli.output import FAILED, INTERRUPTED, USAGE, CliError

if TYPE_CHECKING:
    from ztate.services.runtime.config import Settings

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
Register = Callable[["Subparsers[argparse.ArgumentParser]"], None]
COMMAND_GROUP = "ztate.cli"
BROKEN_PIPE = 141  # 128 + SIGPIPE, as a tool killed by the signal would exit


def _core_commands() -> list[Register]:
    """The core's command groups, in the order ``--help`` lists them. Add a module here
    with one line (its ``register`` takes the top-level subparsers)."""
    from ztate.services.cli import (
        admin,
        completion,
        context,
        db,
        health_probe,
        ledger,
        threads,
        verify,
    )
    from ztate.services.console import command as console

    return [
        context.register,
        ledger.register,
        threads.register,
        verify.register,
        health_probe.register,
        db.register,
        console.register,
        admin.register,
        completion.register,
    ]


def _server_commands() -> list[Register]:
    """The commands the installed services add (``run``, ``serve``, ``approval-serve``, ...).

    The core never imports a server: each service registers its commands under the
    ``ztate.cli`` entry-point group of its distribution (pyproject.toml), found here.
    """
    from importlib import import_module

    registers: list[Register] = []
    for _name, target in sorted(entry_points(COMMAND_GROUP).items()):
        module, _, attribute = target.partition(":")
        registers.append(getattr(import_module(module.strip()), attribute.strip()))
    return registers


def entry_points(group: str) -> dict[str, str]:
    """The entry points of ``group`` (name -> ``module:attribute``) of the installed
    distributions, the first on ``sys.path`` winning, as ``importlib.metadata`` finds
    them; read straight from each ``entry_points.txt``, because importing
    ``importlib.metadata`` alone costs a third of ``ztate --help``."""
    found: dict[str, str] = {}
    header = f"[{group}]"
    for folder in sys.path:
        try:
            names = sorted(os.listdir(folder or "."))
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            path = os.path.join(folder or ".", name, "entry_points.txt")
            try:
                with open(path, encoding="utf-8") as handle:
                    lines = handle.read().splitlines()
            except OSError:
                continue
            inside = False
            for line in lines:
                line = line.strip()
                if line.startswith("["):
                    inside = line == header
                elif inside and "=" in line:
                    key, _, value = line.partition("=")
                    found.setdefault(key.strip(), value.strip())
    return found


def group(
    commands: Subparsers[argparse.ArgumentParser], name: str, help_text: str
) -> Subparsers[argparse.ArgumentParser]:
    """The subcommands of group ``name`` (``ztate threads ...``), created on first use,
    so that several modules can add commands to one group."""
    existing = commands.choices.get(name)
    if existing is not None:
        for action in existing._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action
    parser = commands.add_parser(name, help=help_text, description=help_text)
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


def settings_or_exit() -> Settings:
    """The transition service's settings, or a usage error (exit 2) saying what is wrong."""
    from pydantic import ValidationError

    from ztate.services.runtime.config import Settings, describe

    try:
        return Settings()
    except ValidationError as exc:
        raise CliError(f"invalid configuration: {describe(exc)}", USAGE) from None


class _Version(argparse.Action):
    """``--version``: the installed distribution's version (read only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("ztate")
        except PackageNotFoundError:
            found = "unknown (not installed)"
        print(f"ztate {found}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ztate",
        description="zero-trust control plane for shared agent state "
        "(exit codes: 0 done, 1 failed, 2 usage or configuration, 3 not found, "
        "4 unreachable; docs/cli.md)",
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in (*_server_commands(), *_core_commands()):
        register(commands)
    return parser


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``ztate ledger list -o json | head``): stop
    quietly; stdout goes to /dev/null so that the interpreter's final flush is silent."""
    _discard_stdout()
    return BROKEN_PIPE


def _discard_stdout() -> None:
    """Point file descriptor 1 at /dev/null: what stdout still buffers is dropped by
    the interpreter's final flush, silently, rather than failing there again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


class StdoutFailed(OSError):
    """Writing standard output failed (a full disk, ``> /dev/full``, a closed descriptor,
    an I/O error): told apart from every other ``OSError`` a command may meet."""


class GuardedStdout:
    """``sys.stdout`` while a command runs: the same stream, its write failures raised
    as ``StdoutFailed`` (a reader gone away stays ``BrokenPipeError``: exit 141)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: Any) -> int:
        try:
            written: int = self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as error:
            raise StdoutFailed(error.errno, error.strerror) from None
        return written

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as error:
            raise StdoutFailed(error.errno, error.strerror) from None

    @property
    def buffer(self) -> GuardedStdout:  # the byte stream (``ztate verify --json``)
        return GuardedStdout(self._stream.buffer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class ClosedStdout:
    """Standard output when file descriptor 1 was closed (``ztate ... >&-``): Python
    leaves ``sys.stdout`` None and ``print`` drops what it is given without a word;
    this refuses every write, as a full disk would, so the command says it failed."""

    def __init__(self) -> None:
        self.buffer = self

    def write(self, _text: object) -> int:
        import errno

        raise StdoutFailed(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        return None

    def isatty(self) -> bool:
        return False


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command; a ``CliError`` becomes its line on stderr and exit code.
    Each command turns its own foreseeable failures into ``CliError``s (a database that
    refuses ``ztate serve``: ``store.waiting.DatabaseRefused``, in the serve command)."""
    try:
        result: int = args.func(args)
        return result
    except CliError as error:
        print(f"ztate: {error.message}", file=sys.stderr)
        return error.code


def main(argv: Sequence[str] | None = None) -> int:
    original = sys.stdout
    guarded: Any = GuardedStdout(original) if original is not None else ClosedStdout()
    sys.stdout = guarded
    try:
        return _main(argv)
    finally:
        sys.stdout = original


def _main(argv: Sequence[str] | None) -> int:
    try:
        return dispatch(build_parser().parse_args(argv))
    except CliError as error:
        print(f"ztate: {error.message}", file=sys.stderr)
        return error.code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except StdoutFailed as error:  # > /dev/full, >&-, an I/O error: one line, exit 1
        print(f"ztate: cannot write the output: {error.strerror}", file=sys.stderr)
        if sys.stdout is not None and not isinstance(sys.stdout, ClosedStdout):
            _discard_stdout()  # what it still buffers must not fail the final flush again
        return FAILED
    except KeyboardInterrupt:
        print("ztate: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
