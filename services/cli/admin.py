"""``ztate ca``, ``ztate keys`` and ``ztate policy``: offline administration.

Nothing here talks to a service. Each command imports what it needs when it runs,
so that ``ztate --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from ztate.services.cli.context import home
from ztate.services.cli.output import (
    USAGE,
    CliError,
    add_output_flag,
    dumps,
    emit_list,
    shown,
    shown_lines,
    write,
)
from ztate.services.cli.resources import bounded_int

if TYPE_CHECKING:
    from ztate.services.cli import ca
    from ztate.services.policy.model import PolicySet
    from ztate.services.runtime.config import Settings

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
ROLES = ("service", "node", "operator", "reviewer")  # runtime.identity.Role, unimported


def _settings() -> Settings:
    from ztate.services.cli.main import settings_or_exit

    return settings_or_exit()


def cmd_ca_init(args: argparse.Namespace) -> int:
    from ztate.services.cli import ca

    try:
        path = ca.init_ca(Path(args.dir), args.trust_domain, days=args.days)
    except FileExistsError as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a folder that cannot be made or written
        print(f"ztate: cannot create the CA in {args.dir}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"CA certificate: {path}\nCA key: {Path(args.dir) / ca.CA_KEY} (keep it offline)")
    return 0


def _ttl(args: argparse.Namespace) -> timedelta | None:
    """``--ttl`` parsed, or None when not given; exits 2 with the rule when malformed."""
    from ztate.services.cli import ca

    if args.ttl is None:
        return None
    try:
        return ca.parse_ttl(args.ttl)
    except ValueError as exc:
        raise CliError(f"--ttl: {exc}", USAGE) from None


def _print_issued(spiffe_ids: tuple[str, ...], paths: ca.IssuedPaths) -> None:
    from ztate.services.cli import ca
    from ztate.services.runtime.revocation import serial_text

    issued = ca.Issued.read(paths.cert)
    print(", ".join(spiffe_ids) or paths.cert.stem)
    print(f"  certificate {paths.cert}\n  key         {paths.key}\n  CA          {paths.ca_cert}")
    print(f"  serial      {serial_text(issued.serial)}")
    print(f"  valid until {issued.not_after.isoformat(timespec='seconds')}")


def cmd_ca_issue(args: argparse.Namespace) -> int:
    from ztate.services.cli import ca
    from ztate.services.runtime.identity import NAME, Identity, Role

    if not NAME.fullmatch(args.name):
        raise CliError(f"--name must match {NAME.pattern}", USAGE)
    identity = Identity(args.trust_domain, Role(args.role), args.name)
    ttl = _ttl(args) or ca.DEFAULT_TTL
    try:
        paths = ca.issue(
            Path(args.ca_dir),
            identity,
            Path(args.out),
            dns_names=tuple(args.dns),
            ip_addresses=tuple(args.ip),
            ttl=ttl,
        )
    except (OSError, ValueError) as exc:
        print(f"ztate: cannot issue: {exc}", file=sys.stderr)
        return 1
    _print_issued((identity.spiffe_id,), paths)
    return 0


def cmd_ca_renew(args: argparse.Namespace) -> int:
    """Issue the same identity again with a new key pair, replacing its files atomically."""
    from ztate.services.cli import ca

    if args.cert is not None:
        cert = Path(args.cert)
    elif args.role is not None and args.name is not None:
        cert = Path(args.out) / f"{args.role}-{args.name}.crt"
    else:
        print("ztate ca renew: give --cert FILE, or --role and --name", file=sys.stderr)
        return 2
    ttl = _ttl(args)
    try:
        paths = ca.renew(
            Path(args.ca_dir), cert, ttl=ttl, previous=tuple(Path(p) for p in args.previous_ca)
        )
    except (OSError, ValueError) as exc:
        print(f"ztate: cannot renew: {exc}", file=sys.stderr)
        return 1
    _print_issued(ca.Issued.read(paths.cert).uris, paths)
    print("processes watching these files take the new pair at their next connection")
    return 0


def cmd_ca_revoke(args: argparse.Namespace) -> int:
    """Add a certificate (by serial) or a whole identity (by SPIFFE ID) to the list."""
    from ztate.services.cli import ca
    from ztate.services.runtime.revocation import (
        Entry,
        canonical_spiffe_id,
        now_text,
        parse_serial,
        revoke,
        serial_text,
    )

    path = Path(args.list) if args.list else _settings().revocation_list_file
    assert path is not None
    try:
        if args.spiffe_id is not None:
            canonical_spiffe_id(args.spiffe_id)  # RevocationListError: it would revoke nothing
            entry = Entry(None, args.spiffe_id, now_text(), args.note)
            what = f"identity {args.spiffe_id} (every certificate of it)"
        else:
            serial = (
                parse_serial(args.serial)
                if args.serial is not None
                else ca.Issued.read(Path(args.cert)).serial
            )
            entry = Entry(serial, None, now_text(), args.note)
            what = f"certificate {serial_text(serial)}"
        added = revoke(path, entry)
    except (OSError, ValueError) as exc:
        print(f"ztate: cannot revoke: {exc}", file=sys.stderr)
        return 1
    if not added:
        print(f"{what} was already revoked in {path}")
        return 0
    print(f"revoked {what} in {path}")
    print("running services refuse it from their next call (IDENTITY_REVOKED)")
    return 0


def cmd_keys_init(args: argparse.Namespace) -> int:
    from ztate.contract.keyring import generate_keyring_file

    try:
        generate_keyring_file(Path(args.file), args.key_id)
    except FileExistsError:
        print(f"ztate: {args.file} exists; it is never overwritten", file=sys.stderr)
        return 1
    print(f"HMAC keyring written to {args.file} (mode 0600)")
    return 0


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    """Add a new HMAC key and make it current; old keys stay to verify old records."""
    from ztate.contract.errors import KeyringError
    from ztate.contract.keyring import rotate_keyring_file

    try:
        key_id = rotate_keyring_file(Path(args.file), args.key_id)
    except KeyringError as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return 1
    print(f"added key {key_id!r} to {args.file} and made it current (mode 0600)")
    print("restart the transition service to sign new records under it")
    return 0


def cmd_keys_signing_key(args: argparse.Namespace) -> int:
    """A new Ed25519 key for the approval service's receipts or the checkpoints."""
    from ztate.contract.errors import KeyFileError
    from ztate.contract.keyring import add_signing_key

    try:
        add_signing_key(args.private, args.public, args.key_id)
    except KeyFileError as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return 1
    print(f"Ed25519 signing key {args.key_id!r} written to {args.private} (mode 0600)")
    print(f"its public half added to {args.public}: give that file to the verifiers")
    return 0


def _load_policies(path: Path) -> PolicySet | None:
    from ztate.services.policy.model import PolicyError, PolicySet

    try:
        return PolicySet.load(path)
    except PolicyError as exc:
        # one problem a line (the model joins them with "\n"); each line escaped: a key
        # or value of the file may hold what a terminal acts on
        print(f"ztate: invalid policy:\n{shown_lines(str(exc).split(chr(10)))}", file=sys.stderr)
        return None
    except RecursionError:  # YAML or JSON nested past the parser's stack
        print(f"ztate: invalid policy:\n{shown(str(path))}: nested too deeply", file=sys.stderr)
        return None


def cmd_policy_check(args: argparse.Namespace) -> int:
    """Validate a policy file or folder offline."""
    policies = _load_policies(Path(args.path))
    if policies is None:
        return 1
    rows = [{"name": p.name, "digest": p.digest, "valid": True} for p in policies.policies.values()]
    if args.output == "table":
        for row in rows:
            print(f"{row['name']}: valid, digest {row['digest']}")
    else:
        emit_list(rows, args.output, [("name", lambda r: r["name"])])
    return 0


def cmd_policy_show(args: argparse.Namespace) -> int:
    """Print the effective policy: every default filled in, with its digest."""
    path = Path(args.path) if args.path else _settings().policy_path
    assert path is not None
    policies = _load_policies(path)
    if policies is None:
        return 1
    rows = [
        {"name": p.name, "digest": p.digest, "document": p.document.model_dump(mode="json")}
        for p in policies.policies.values()
    ]
    if args.output != "table":
        emit_list(rows, args.output, [("name", lambda r: r["name"])])
        return 0
    for row in rows:
        print(f"# policy {row['name']}, digest {row['digest']}")
        write(dumps(row["document"]))
    return 0


def register(commands: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``ca``, ``keys`` and ``policy`` to the ``ztate`` command."""
    ca_parser = commands.add_parser("ca", help="a development certificate authority")
    ca_sub = ca_parser.add_subparsers(dest="ca_command", required=True)
    init = ca_sub.add_parser("init", help="create a CA")
    init.add_argument(
        "--dir", default=str(home() / "ca"), help="the CA's folder (default $ZTATE_HOME/ca)"
    )
    init.add_argument(
        "--trust-domain", default="ztate.local", help="SPIFFE trust domain (default %(default)s)"
    )
    init.add_argument(
        "--days",
        type=bounded_int(1, 36_500),
        default=3650,
        help="how long the CA is valid (default %(default)s)",
    )
    init.set_defaults(func=cmd_ca_init)
    issue = ca_sub.add_parser("issue", help="issue a certificate for one identity")
    issue.add_argument("--role", required=True, choices=ROLES, help="what the identity is")
    issue.add_argument("--name", required=True, help="its name: lower-case letters, digits, -")
    issue.add_argument(
        "--trust-domain", default="ztate.local", help="SPIFFE trust domain (default %(default)s)"
    )
    issue.add_argument(
        "--ca-dir", default=str(home() / "ca"), help="the CA (default $ZTATE_HOME/ca)"
    )
    issue.add_argument(
        "--out",
        default=str(home() / "certs"),
        help="where ROLE-NAME.crt/.key go (default $ZTATE_HOME/certs)",
    )
    issue.add_argument("--dns", action="append", default=[], help="DNS SAN (servers)")
    issue.add_argument("--ip", action="append", default=[], help="IP SAN (servers)")
    issue.add_argument(
        "--ttl", help="how long it is valid: 90m, 24h, 7d (default 1d: renew with ztate ca renew)"
    )
    issue.set_defaults(func=cmd_ca_issue)
    renew = ca_sub.add_parser(
        "renew",
        help="issue an identity again with a new key pair (files replaced atomically)",
        description="Reads the certificate, issues one for the same SPIFFE ID and SANs with a "
        "new key pair, and renames both files over the old ones: services and workers watching "
        "them take the new pair at their next connection, without a restart.",
    )
    renew.add_argument("--cert", help="the certificate to renew (its .key beside it)")
    renew.add_argument("--role", choices=ROLES, help="with --name, in --out")
    renew.add_argument("--name", help="with --role: the identity's name")
    renew.add_argument(
        "--out",
        default=str(home() / "certs"),
        help="where ROLE-NAME.crt is (default $ZTATE_HOME/certs)",
    )
    renew.add_argument(
        "--ca-dir", default=str(home() / "ca"), help="the CA (default $ZTATE_HOME/ca)"
    )
    renew.add_argument("--ttl", help="90m, 24h, 7d (default: the old certificate's lifetime)")
    renew.add_argument(
        "--previous-ca",
        action="append",
        default=[],
        metavar="DIR",
        help="a CA whose certificates --ca-dir may renew too (a CA rotation's overlap: the "
        "old CA's folder, or a file of its certificate); repeatable",
    )
    renew.set_defaults(func=cmd_ca_renew)
    revoke_parser = ca_sub.add_parser(
        "revoke",
        help="refuse a certificate (by serial) or an identity (by SPIFFE ID) from now on",
        description="Adds an entry to the revocation list (JSON, mode 0644, replaced "
        "atomically; docs/operations.md). Both services read it again when it changes and "
        "refuse the certificate or identity at its next call, on open connections too.",
    )
    revoked = revoke_parser.add_mutually_exclusive_group(required=True)
    revoked.add_argument("--serial", help="hexadecimal, as openssl x509 -serial prints it")
    revoked.add_argument("--cert", help="the certificate file whose serial to revoke")
    revoked.add_argument("--spiffe-id", help="every certificate of this identity")
    revoke_parser.add_argument(
        "--list", help="the list file (default: ZTATE_REVOCATION_LIST_FILE, in $ZTATE_HOME/certs)"
    )
    revoke_parser.add_argument("--note", default="", help="why (kept in the list)")
    revoke_parser.set_defaults(func=cmd_ca_revoke)

    keys = commands.add_parser("keys", help="HMAC chain keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    keys_init = keys_sub.add_parser("init", help="write a new keyring file")
    keys_init.add_argument(
        "--file",
        default=str(home() / "keys" / "hmac-keyring.json"),
        help="the keyring (default $ZTATE_HOME/keys/hmac-keyring.json)",
    )
    keys_init.add_argument("--key-id", default="k1", help="the first key's id (default k1)")
    keys_init.set_defaults(func=cmd_keys_init)
    keys_rotate = keys_sub.add_parser("rotate", help="add a new key and make it current")
    keys_rotate.add_argument(
        "--file",
        default=str(home() / "keys" / "hmac-keyring.json"),
        help="the keyring (default $ZTATE_HOME/keys/hmac-keyring.json)",
    )
    keys_rotate.add_argument("--key-id", help="default: the next free kN")
    keys_rotate.set_defaults(func=cmd_keys_rotate)
    signing = keys_sub.add_parser(
        "signing-key",
        help="a new Ed25519 signing key (approval receipts or checkpoints) and its public half",
        description="Writes the private key (PEM, mode 0600; never overwritten) and adds its "
        "public half to the public keyring file under --key-id (created if missing; old keys "
        "stay, so rotating keeps old signatures verifiable).",
    )
    signing.add_argument("--private", required=True, type=Path, help="the new private key file")
    signing.add_argument("--public", required=True, type=Path, help="the public keyring file")
    signing.add_argument("--key-id", required=True, help="1-64 characters of [A-Za-z0-9._-]")
    signing.set_defaults(func=cmd_keys_signing_key)

    policy = commands.add_parser("policy", help="policies")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate a policy file or folder offline")
    check.add_argument("path", help="a policy file, or a folder of them")
    add_output_flag(check)
    check.set_defaults(func=cmd_policy_check)
    show = policy_sub.add_parser("show", help="print the effective policy and its digest")
    show.add_argument("path", nargs="?", help="default: ZTATE_POLICY_PATH")
    add_output_flag(show)
    show.set_defaults(func=cmd_policy_show)
