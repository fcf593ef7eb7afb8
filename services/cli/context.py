"""One connection context for every client command (``ledger``, ``threads``, ``approvals``).

Where a command connects and with which certificate, each setting taken from the first
of these that gives it (docs/cli.md):

1. its flag: ``--address`` (``--target``), ``--client-cert`` (``--cert``),
   ``--client-key`` (``--key``), ``--ca-cert`` (``--ca``), ``--server-name``, and for
   reviewers ``--reviewer NAME`` (the development layout's ``reviewer-NAME.*``);
2. the environment: ``ZTATE_ADDRESS`` (the transition service) or
   ``ZTATE_APPROVAL_ADDRESS`` (the approval service), ``ZTATE_CERT``, ``ZTATE_KEY``,
   ``ZTATE_CA``, ``ZTATE_SERVER_NAME``;
3. the context chosen by ``--context NAME``, ``ZTATE_CONTEXT`` or the file's
   ``current-context``, in the context file (``$ZTATE_CONFIG``, else
   ``$XDG_CONFIG_HOME/ztate/config.yaml``, else ``~/.config/ztate/config.yaml``);
4. the local development layout: the address the service is configured to listen on
   (``ZTATE_LISTEN`` / ``ZTATE_APPROVAL_LISTEN``, default ports 7443 / 7444) and the
   certificates under ``$ZTATE_HOME/certs`` (``operator-admin.*``, ``reviewer-alice.*``).

Only the standard library at import time (and PyYAML when a context file is read).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from ztate.services.cli.output import (
    OK,
    USAGE,
    CliError,
    Column,
    add_output_flag,
    emit_list,
    emit_one,
    rpc_error,
    shown_lines,
    usage,
)

TRANSITION, APPROVAL = "transition", "approval"
DEFAULT_LISTEN = {TRANSITION: "127.0.0.1:7443", APPROVAL: "127.0.0.1:7444"}
ADDRESS_ENV = {TRANSITION: "ZTATE_ADDRESS", APPROVAL: "ZTATE_APPROVAL_ADDRESS"}
LISTEN_ENV = {TRANSITION: "ZTATE_LISTEN", APPROVAL: "ZTATE_APPROVAL_LISTEN"}
ADDRESS_FIELD = {TRANSITION: "address", APPROVAL: "approval-address"}
FIELDS = ("address", "approval-address", "cert", "key", "ca", "server-name")
CONTEXT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")  # fullmatch
NAME_RULE = "1-128 characters of letters, digits and . _ : @ / -, the first a letter or digit"
MAX_SETTING_CHARS = 4096
MAX_CONTEXT_FILE = 1024 * 1024  # bytes: a context file of names and paths is a few KB
DEFAULT_OPERATOR = "operator-admin"
DEFAULT_REVIEWER = "alice"

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()


def home() -> Path:
    return Path(os.environ.get("ZTATE_HOME") or ".ztate")


def config_path() -> Path:
    explicit = os.environ.get("ZTATE_CONFIG")
    if explicit:
        return Path(_setting("ZTATE_CONFIG", explicit))
    xdg = os.environ.get("XDG_CONFIG_HOME")
    if xdg:
        return Path(_setting("XDG_CONFIG_HOME", xdg)) / "ztate" / "config.yaml"
    # without it, $HOME/.config: a value that breaks the rule is HOME's, say so
    return Path(_setting("HOME", str(Path.home()))) / ".config" / "ztate" / "config.yaml"


class ContextFile:
    """The context file: named contexts and the current one."""

    def __init__(
        self, path: Path, current: str | None, contexts: dict[str, dict[str, str]]
    ) -> None:
        self.path, self.current, self.contexts = path, current, contexts

    @classmethod
    def load(cls, path: Path | None = None) -> ContextFile:
        from ztate.contract.files import FileTooLarge, read_bounded

        path = path or config_path()
        try:  # bounded: a link to /dev/zero must not fill memory
            text = read_bounded(path, MAX_CONTEXT_FILE, "a context file").decode("utf-8")
        except FileNotFoundError:
            return cls(path, None, {})
        except OSError as exc:
            usage(f"cannot read the context file {path}: {exc.strerror}")
        except FileTooLarge:
            usage(f"the context file {path} holds more than {MAX_CONTEXT_FILE:,} bytes")
        except UnicodeDecodeError:
            usage(f"the context file {path} is not UTF-8 text")
        import yaml

        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            usage(f"the context file {path} is not YAML: {str(exc).splitlines()[0]}")
        except RecursionError:
            usage(f"the context file {path} nests too deeply")
        if not isinstance(doc, dict):
            usage(f"the context file {path} must be a mapping")
        contexts = doc.get("contexts") or {}
        current = doc.get("current-context")
        if not isinstance(contexts, dict) or not (current is None or isinstance(current, str)):
            usage(f"{path}: `contexts` must map names to settings; `current-context` a name")
        # a hand-edited file is held to what `context set` writes: names and values are
        # printed by `context list` and `show`, and a name is not echoed until it passes
        if current is not None and not CONTEXT_NAME.fullmatch(current):
            usage(f"{path}: `current-context` is not a context name ({NAME_RULE})")
        checked: dict[str, dict[str, str]] = {}
        for number, (name, fields) in enumerate(contexts.items(), start=1):
            if not CONTEXT_NAME.fullmatch(str(name)):
                usage(f"{path}: the name of context number {number} is not one ({NAME_RULE})")
            if not isinstance(fields, dict):
                usage(f"{path}: context {name!r} must be a mapping")
            unknown = [key for key in fields if key not in FIELDS]
            if unknown:  # named only when each is a name: a hand-edited key may hold anything
                named = all(isinstance(k, str) and CONTEXT_NAME.fullmatch(k) for k in unknown)
                which = ", ".join(sorted(unknown)) if named else f"{len(unknown)} setting(s)"
                usage(f"{path}: context {name!r}: unknown {which} (known: {', '.join(FIELDS)})")
            if not all(isinstance(v, str) for v in fields.values()):
                usage(f"{path}: context {name!r}: every value is a string")
            for field, value in fields.items():
                _setting(f"{path}: context {name!r}: {field}", value)
            checked[str(name)] = dict(fields)
        return cls(path, current, checked)

    def save(self) -> None:
        """Written as every file ztate replaces: a new temporary file of a random name
        (never one planted in a shared folder, nor followed through a link), mode 0600
        from its first byte, renamed over the old."""
        import yaml

        from ztate.services.runtime.reloading import write_atomically

        doc: dict[str, Any] = {"contexts": self.contexts}
        if self.current is not None:
            doc["current-context"] = self.current
        text = yaml.safe_dump(doc, sort_keys=True, default_flow_style=False)
        try:
            write_atomically(self.path, text.encode("utf-8"), 0o600)
        except OSError as exc:  # a folder that is missing, read-only, or not one
            usage(f"cannot write the context file {self.path}: {exc.strerror or exc}")

    def selected(self, flag: str | None) -> tuple[str | None, dict[str, str]]:
        """The context in force: ``--context``, ``ZTATE_CONTEXT``, ``current-context``."""
        chosen = os.environ.get("ZTATE_CONTEXT")
        if not flag and chosen and not CONTEXT_NAME.fullmatch(chosen):
            usage(f"ZTATE_CONTEXT: not a context name: {NAME_RULE}")  # not echoed
        name = flag or chosen or self.current
        if name is None:
            return None, {}
        if name not in self.contexts:
            known = ", ".join(sorted(self.contexts)) or "none"
            usage(f"no context {name!r} in {self.path} (known: {known}; `ztate context set`)")
        return name, self.contexts[name]


class Connection(NamedTuple):
    """Where to connect and as whom; ``sources`` says where each setting came from."""

    address: str
    cert: Path
    key: Path
    ca: Path
    server_name: str | None
    context: str | None
    sources: dict[str, str]


def _local_address(service: str) -> tuple[str, str]:
    variable = LISTEN_ENV[service]
    listen = os.environ.get(variable)
    if not listen:
        return DEFAULT_LISTEN[service], "default"
    _setting(variable, listen)
    host, _, port = listen.rpartition(":")
    if host in {"", "0.0.0.0", "::", "[::]"}:  # noqa: S104 (a listen address, read)
        host = "localhost"
    return f"{host}:{port}", variable


def resolve(
    args: argparse.Namespace, service: str = TRANSITION, flag_names: dict[str, str] | None = None
) -> Connection:
    """The connection of a client command, from its flags, the environment, the
    context and the development layout, in that order. ``flag_names`` names the flags
    of a command whose flags are not the usual ones (``args`` attribute: flag), for
    its errors."""
    context_name, context = ContextFile.load().selected(getattr(args, "context", None))
    sources: dict[str, str] = {}

    # what flags and the environment give is held to what the context file may hold
    # (``_setting``): each may be printed (``context show``, an error naming a file)
    def flag(name: str) -> str | None:
        value = getattr(args, name, None)
        shown = (flag_names or {}).get(name) or f"--{name.replace('_', '-')}"
        return _setting(shown, str(value)) if value else None

    def pick(field: str, name: str, env: str) -> str | None:
        value = flag(name)
        if value:
            sources[field] = "flag"
            return value
        if os.environ.get(env):
            sources[field] = env
            return _setting(env, os.environ[env])
        if context.get(field):
            sources[field] = f"context {context_name}"
            return context[field]
        return None

    address = pick(ADDRESS_FIELD[service], "address", ADDRESS_ENV[service])
    if address is None:
        address, sources[ADDRESS_FIELD[service]] = _local_address(service)
    reviewer = getattr(args, "reviewer", None)
    if reviewer:  # --reviewer NAME: the development layout's reviewer, over env and context
        stem, files_from = f"reviewer-{_setting('--reviewer', reviewer)}", "--reviewer"
        cert, key = flag("client_cert"), flag("client_key")
        sources.update(cert="flag" if cert else files_from, key="flag" if key else files_from)
    else:
        stem = DEFAULT_OPERATOR if service == TRANSITION else f"reviewer-{DEFAULT_REVIEWER}"
        cert = pick("cert", "client_cert", "ZTATE_CERT")
        key = pick("key", "client_key", "ZTATE_KEY")
    ca = pick("ca", "ca_cert", "ZTATE_CA")
    server_name = pick("server-name", "server_name", "ZTATE_SERVER_NAME")
    defaults: dict[str, Path] = {}
    if None in (cert, key, ca):  # ZTATE_HOME is read (and held to the rule) only if used
        certs = Path(_setting("ZTATE_HOME", str(home()))) / "certs"
        defaults = {"cert": certs / f"{stem}.crt", "key": certs / f"{stem}.key"}
        defaults["ca"] = certs / "ca.crt"
    for field, value in (("cert", cert), ("key", key), ("ca", ca)):
        if value is None:
            sources[field] = f"$ZTATE_HOME/certs ({defaults[field].parent})"
    return Connection(
        address=address,
        cert=Path(cert) if cert else defaults["cert"],
        key=Path(key) if key else defaults["key"],
        ca=Path(ca) if ca else defaults["ca"],
        server_name=server_name,
        context=context_name,
        sources=sources,
    )


def add_connection_flags(parser: argparse.ArgumentParser, service: str = TRANSITION) -> None:
    """The flags of a client command; each falls back as the module's docstring says."""
    group = parser.add_argument_group("connection (flags > environment > context > $ZTATE_HOME)")
    env = ADDRESS_ENV[service]
    group.add_argument(
        "--address",
        metavar="HOST:PORT",
        help=f"the {service} service (env {env}; default: {LISTEN_ENV[service]} on localhost)",
    )
    group.add_argument("--target", dest="address", help=argparse.SUPPRESS)
    group.add_argument(
        "--client-cert", metavar="FILE", help="your certificate, PEM (env ZTATE_CERT)"
    )
    group.add_argument("--cert", dest="client_cert", help=argparse.SUPPRESS)
    group.add_argument("--client-key", metavar="FILE", help="its private key, PEM (env ZTATE_KEY)")
    group.add_argument("--key", dest="client_key", help=argparse.SUPPRESS)
    group.add_argument("--ca-cert", metavar="FILE", help="the CA certificate, PEM (env ZTATE_CA)")
    group.add_argument("--ca", dest="ca_cert", help=argparse.SUPPRESS)
    group.add_argument(
        "--server-name",
        help="expected server name, if not the address's host (env ZTATE_SERVER_NAME)",
    )
    group.add_argument(
        "--context",
        type=context_name,
        help="a context of the context file (env ZTATE_CONTEXT; `ztate context`)",
    )


def secure_channel(args: argparse.Namespace, service: str = TRANSITION) -> tuple[Any, Connection]:
    """A function opening an mTLS channel for a client command (call it inside the event
    loop that uses the channel), and the connection it opens. Unreadable credentials are
    a usage error (exit 2) naming the file, raised here, before anything is dialled."""
    connection = resolve(args, service)
    return connect(
        connection.address, connection.cert, connection.key, connection.ca, connection.server_name
    ), connection


CLIENT_HINT = "(give --client-cert/--client-key/--ca-cert, ZTATE_CERT/KEY/CA or a context)"


def connect(
    address: str,
    cert: Path,
    key: Path,
    ca: Path,
    server_name: str | None = None,
    *,
    hint: str = CLIENT_HINT,
) -> Callable[[], Any]:
    """A function opening an mTLS channel to ``address`` as ``cert``: the one channel of
    every client (the commands here, ``ztate console``), accepting any reply a ztate
    server may legally send (``tls.client_options``). The files are read and checked
    now (``tls.checked_files``): an unreadable or unusable one is a usage error (exit 2)
    naming it, and ``hint`` says where such files are given."""
    import grpc

    from ztate.contract.errors import KeyFileError
    from ztate.services.runtime.tls import checked_files, client_options

    try:  # in the order people give them: the certificate first
        cert_pem, key_pem, ca_pem = checked_files(cert, key, ca)
    except OSError as exc:
        raise CliError(
            f"cannot read credentials: {exc.filename}: {exc.strerror} {hint}", USAGE
        ) from None
    except KeyFileError as exc:
        raise CliError(f"cannot use credentials: {exc} {hint}", USAGE) from None
    credentials = grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)
    options = client_options(server_name)

    def open_channel() -> Any:
        return grpc.aio.secure_channel(address, credentials, options=options)

    return open_channel


_T = TypeVar("_T")


def run_client(
    args: argparse.Namespace,
    call: Callable[[Any], Awaitable[_T]],
    service: str = TRANSITION,
) -> _T:
    """Connect as ``args`` say, make ``call(channel)``, and turn a failed call into a
    ``CliError`` with the exit code of its status (not found 3, unreachable 4, ...)."""
    import asyncio

    import grpc

    open_channel, connection = secure_channel(args, service)

    async def connected() -> _T:
        async with open_channel() as made:
            return await call(made)

    try:
        return asyncio.run(connected())
    except grpc.aio.AioRpcError as error:
        raise rpc_error(error, connection.address) from None


# --- ztate context ----------------------------------------------------------------------


def context_name(text: str) -> str:
    """An argparse type: a context's name (``CONTEXT_NAME``), else exit 2. The name is
    not echoed: it may be long, or hold what a terminal would act on."""
    if not CONTEXT_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a context name: {NAME_RULE}")
    return text


def _setting(flag: str, value: str) -> str:
    """A setting as given to ``context set``, a flag or the environment: only characters
    Python calls printable (no control character, which would reach a terminal or a DNS
    name; no bidi override or line separator), at most MAX_SETTING_CHARS, else a usage
    error naming ``flag``, never the value."""
    if len(value) > MAX_SETTING_CHARS:
        usage(f"{flag}: more than {MAX_SETTING_CHARS} characters")
    if value.isprintable():
        return value
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
        usage(f"{flag}: control characters are not allowed")
    # what else Python does not call printable: a bidi override (U+202E), a line or
    # paragraph separator (U+2028), another format character: each reorders or breaks
    # the line that shows the value
    usage(f"{flag}: unprintable characters (format characters, separators) are not allowed")


CONTEXT_COLUMNS: list[Column] = [
    ("current", lambda r: "*" if r["current"] else ""),
    ("name", lambda r: r["name"]),
    ("address", lambda r: r.get("address")),
    ("approval-address", lambda r: r.get("approval-address")),
    ("cert", lambda r: r.get("cert")),
]


def cmd_context_list(args: argparse.Namespace) -> int:
    found = ContextFile.load()
    rows = [
        {"name": name, "current": name == found.current, **fields}
        for name, fields in sorted(found.contexts.items())
    ]
    emit_list(rows, args.output, CONTEXT_COLUMNS, empty=f"no contexts in {found.path}")
    return OK


def cmd_context_use(args: argparse.Namespace) -> int:
    found = ContextFile.load()
    if args.name not in found.contexts:
        known = ", ".join(sorted(found.contexts)) or "none"
        usage(f"no context {args.name!r} in {found.path} (known: {known})")
    found.current = args.name
    found.save()
    print(f"current context: {args.name}")
    return OK


def cmd_context_set(args: argparse.Namespace) -> int:
    given = {
        "address": args.address,
        "approval-address": args.approval_address,
        "cert": args.client_cert,
        "key": args.client_key,
        "ca": args.ca_cert,
        "server-name": args.server_name,
    }
    for field, value in given.items():  # all checked before the file is read or written
        if value is not None:
            _setting(f"--{field}", value)
    found = ContextFile.load()
    fields = found.contexts.setdefault(args.name, {})
    for field, value in given.items():
        if value is None:
            continue
        if value == "":
            fields.pop(field, None)
        elif field in {"cert", "key", "ca"}:
            # absolute, links kept: a rotated secret (tls.crt -> ..data/tls.crt) stays
            # the name the operator gave, and the stored value is held to the same rule
            expanded = os.path.expanduser(value)
            if expanded.startswith("~"):
                usage(f"--{field}: cannot expand ~USER: no such user")  # not echoed
            fields[field] = _setting(f"--{field}", os.path.abspath(expanded))
        else:
            fields[field] = value
    if found.current is None or args.use:
        found.current = args.name
    found.save()
    print(
        f"context {args.name} saved in {found.path}"
        + (" (current)" if found.current == args.name else "")
    )
    return OK


def cmd_context_delete(args: argparse.Namespace) -> int:
    found = ContextFile.load()
    if found.contexts.pop(args.name, None) is None:
        raise CliError(f"no context {args.name!r} in {found.path}", 3)
    if found.current == args.name:
        found.current = None
    found.save()
    print(f"context {args.name} deleted")
    return OK


def cmd_context_show(args: argparse.Namespace) -> int:
    """The settings every client command would use now, and where each came from."""
    shown: dict[str, Any] = {"file": str(config_path())}
    for service in (TRANSITION, APPROVAL):
        connection = resolve(args, service)
        shown["context"] = connection.context
        fields = connection._asdict()
        fields.pop("context")
        shown[service] = {k: (str(v) if isinstance(v, Path) else v) for k, v in fields.items()}

    def text(doc: dict[str, Any]) -> str:
        lines = [f"context      {doc['context'] or '(none)'}  ({doc['file']})"]
        for service in (TRANSITION, APPROVAL):
            part = doc[service]
            lines.append(f"{service}")
            for field in ("address", "cert", "key", "ca", "server_name"):
                came = part["sources"].get(field.replace("_", "-")) or part["sources"].get(
                    ADDRESS_FIELD[service] if field == "address" else field, ""
                )
                value = part[field] if part[field] is not None else "-"
                lines.append(f"  {field:<12} {value}" + (f"   [{came}]" if came else ""))
        return shown_lines(lines)

    emit_one(shown, args.output, text)
    return OK


def register(commands: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``context`` to the ``ztate`` command."""
    context = commands.add_parser(
        "context",
        help="named connection settings, like kubeconfig (list, use, show, set, delete)",
        description=__doc__.split("\n\nOnly")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = context.add_subparsers(dest="context_command", required=True, metavar="COMMAND")
    listing = sub.add_parser("list", help="the contexts of the context file (* current)")
    add_output_flag(listing)
    listing.set_defaults(func=cmd_context_list)
    use = sub.add_parser("use", help="make a context the current one")
    use.add_argument("name", type=context_name, help="the context's name")
    use.set_defaults(func=cmd_context_use)
    show = sub.add_parser(
        "show", help="what client commands would use now, and where each setting came from"
    )
    show.add_argument(
        "--context", type=context_name, help="show this context instead of the current one"
    )
    add_output_flag(show)
    show.set_defaults(func=cmd_context_show, reviewer=None)
    setting = sub.add_parser(
        "set", help="create or change a context (an empty value removes a setting)"
    )
    setting.add_argument("name", type=context_name, help=f"the context's name ({NAME_RULE})")
    setting.add_argument("--address", help="the transition service's HOST:PORT")
    setting.add_argument("--approval-address", help="the approval service's HOST:PORT")
    setting.add_argument("--client-cert", "--cert", help="your certificate file (PEM)")
    setting.add_argument("--client-key", "--key", help="its private key file (PEM)")
    setting.add_argument("--ca-cert", "--ca", help="the CA certificate file (PEM)")
    setting.add_argument("--server-name", help="expected server name, if not the host")
    setting.add_argument("--use", action="store_true", help="also make it the current context")
    setting.set_defaults(func=cmd_context_set)
    delete = sub.add_parser("delete", help="remove a context")
    delete.add_argument("name", type=context_name, help="the context's name")
    delete.set_defaults(func=cmd_context_delete)
