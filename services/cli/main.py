"""The ``ztate`` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Callable, Coroutine, Sequence
from datetime import datetime, timedelta
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format, timestamp_pb2
from pydantic import ValidationError

from ztate.contract.errors import KeyFileError, KeyringError
from ztate.contract.keyring import add_signing_key, generate_keyring_file, rotate_keyring_file
from ztate.services.cli import ca
from ztate.services.cli.db import add_db_commands
from ztate.services.cli.health_probe import add_health_command
from ztate.services.cli.operator_client import add_connection_flags, operator_channel
from ztate.services.cli.threads import add_thread_commands
from ztate.services.cli.verify import add_export_command, add_verify_commands
from ztate.services.policy.model import PolicyError, PolicySet
from ztate.services.runtime.config import Settings, describe
from ztate.services.runtime.identity import NAME, Identity, Role
from ztate.services.runtime.revocation import (
    Entry,
    RevocationListError,
    now_text,
    parse_serial,
    revoke,
    serial_text,
)
from ztate.v1 import ledger_pb2, ledger_pb2_grpc, transition_pb2, transition_pb2_grpc


def _settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        raise SystemExit(f"ztate: invalid configuration: {describe(exc)}") from None


def _configure_logging(settings: Settings) -> None:
    from ztate.services.runtime.telemetry import configure_logging

    configure_logging(settings.log_format)


def cmd_ca_init(args: argparse.Namespace) -> int:
    try:
        path = ca.init_ca(Path(args.dir), args.trust_domain, days=args.days)
    except FileExistsError as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return 1
    print(f"CA certificate: {path}\nCA key: {Path(args.dir) / ca.CA_KEY} (keep it offline)")
    return 0


def _ttl(args: argparse.Namespace) -> timedelta | None:
    """``--ttl`` parsed, or None when not given; exits 2 with the rule when malformed."""
    if args.ttl is None:
        return None
    try:
        return ca.parse_ttl(args.ttl)
    except ValueError as exc:
        raise SystemExit(f"ztate: --ttl: {exc}") from None


def _print_issued(spiffe_ids: tuple[str, ...], paths: ca.IssuedPaths) -> None:
    issued = ca.Issued.read(paths.cert)
    print(", ".join(spiffe_ids) or paths.cert.stem)
    print(f"  certificate {paths.cert}\n  key         {paths.key}\n  CA          {paths.ca_cert}")
    print(f"  serial      {serial_text(issued.serial)}")
    print(f"  valid until {issued.not_after.isoformat(timespec='seconds')}")


def cmd_ca_issue(args: argparse.Namespace) -> int:
    if not NAME.fullmatch(args.name):
        print(f"ztate: name must match {NAME.pattern}", file=sys.stderr)
        return 1
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
    except (FileNotFoundError, ValueError) as exc:
        print(f"ztate: cannot issue: {exc}", file=sys.stderr)
        return 1
    _print_issued((identity.spiffe_id,), paths)
    return 0


def cmd_ca_renew(args: argparse.Namespace) -> int:
    """Issue the same identity again with a new key pair, replacing its files atomically."""
    if args.cert is not None:
        cert = Path(args.cert)
    elif args.role is not None and args.name is not None:
        cert = Path(args.out) / f"{args.role}-{args.name}.crt"
    else:
        print("ztate ca renew: give --cert FILE, or --role and --name", file=sys.stderr)
        return 2
    ttl = _ttl(args)
    try:
        paths = ca.renew(Path(args.ca_dir), cert, ttl=ttl)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ztate: cannot renew: {exc}", file=sys.stderr)
        return 1
    _print_issued(ca.Issued.read(paths.cert).uris, paths)
    print("processes watching these files take the new pair at their next connection")
    return 0


def cmd_ca_revoke(args: argparse.Namespace) -> int:
    """Add a certificate (by serial) or a whole identity (by SPIFFE ID) to the list."""
    path = Path(args.list) if args.list else _settings().revocation_list_file
    assert path is not None
    try:
        if args.spiffe_id is not None:
            if not args.spiffe_id.startswith("spiffe://"):
                raise RevocationListError(f"{args.spiffe_id!r} is not a SPIFFE ID")
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
    try:
        generate_keyring_file(Path(args.file), args.key_id)
    except FileExistsError:
        print(f"ztate: {args.file} exists; it is never overwritten", file=sys.stderr)
        return 1
    print(f"HMAC keyring written to {args.file} (mode 0600)")
    return 0


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    """Add a new HMAC key and make it current; old keys stay to verify old records."""
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
    try:
        add_signing_key(args.private, args.public, args.key_id)
    except KeyFileError as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return 1
    print(f"Ed25519 signing key {args.key_id!r} written to {args.private} (mode 0600)")
    print(f"its public half added to {args.public}: give that file to the verifiers")
    return 0


def _load_policies(path: Path) -> PolicySet | None:
    try:
        return PolicySet.load(path)
    except PolicyError as exc:
        print(f"ztate: invalid policy:\n{exc}", file=sys.stderr)
        return None


def cmd_policy_check(args: argparse.Namespace) -> int:
    """Validate a policy file or folder offline."""
    policies = _load_policies(Path(args.path))
    if policies is None:
        return 1
    for policy in policies.policies.values():
        print(f"{policy.name}: valid, digest {policy.digest}")
    return 0


def cmd_policy_show(args: argparse.Namespace) -> int:
    """Print the effective policy: every default filled in, with its digest."""
    path = Path(args.path) if args.path else _settings().policy_path
    assert path is not None
    policies = _load_policies(path)
    if policies is None:
        return 1
    for policy in policies.policies.values():
        print(f"# policy {policy.name}, digest {policy.digest}")
        print(json.dumps(policy.document.model_dump(mode="json"), indent=2))
    return 0


def _parse_time(text: str) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(datetime.fromisoformat(text.replace("Z", "+00:00")))
    return stamp


async def _list_rejections(args: argparse.Namespace) -> list[dict[str, Any]]:
    request = ledger_pb2.ListRejectionsRequest(
        thread_id=args.thread or "",
        node_id=args.node or "",
        reason=args.reason or "",
        page_size=min(args.limit, 1000),
    )
    if args.since:
        request.since.CopyFrom(_parse_time(args.since))
    if args.until:
        request.until.CopyFrom(_parse_time(args.until))
    found: list[dict[str, Any]] = []
    async with operator_channel(args, _settings().home) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        while len(found) < args.limit:
            response = await stub.ListRejections(request, timeout=30)
            found += [
                json_format.MessageToDict(r, preserving_proto_field_name=True)
                for r in response.rejections
            ]
            if not response.next_page_token:
                break
            request.page_token = response.next_page_token
    return found[: args.limit]


def cmd_ledger_rejections(args: argparse.Namespace) -> int:
    """List refused proposals, newest first."""
    try:
        rows = asyncio.run(_list_rejections(args))
    except grpc.aio.AioRpcError as error:
        print(f"ztate: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return 0
    for row in rows:
        keys = ",".join(row.get("keys", [])) or "-"
        print(
            f"{row['rejected_at']}  {row['reason']:<22} {row.get('thread_id', '-')}"
            f"@{row.get('base_version', 0)}  {row['node_id']}  keys={keys}"
        )
    if not rows:
        print("no rejections match")
    return 0


_T = TypeVar("_T")


def _as_dict(message: Any) -> dict[str, Any]:
    found: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return found


def _ledger_query(query: Coroutine[Any, Any, _T]) -> _T | None:
    """Run one ledger query; a printed error and None when it fails."""
    try:
        return asyncio.run(query)
    except grpc.aio.AioRpcError as error:
        print(f"ztate: {error.code().name}: {error.details()}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"ztate: {exc}", file=sys.stderr)
    return None


async def _list_transitions(args: argparse.Namespace) -> list[dict[str, Any]]:
    request = ledger_pb2.ListTransitionsRequest(
        thread_id=args.thread or "",
        node_id=args.node or "",
        changed_key=args.changed_key or "",
        status=args.status or "",
        page_size=min(args.limit, 1000),
    )
    if args.since:
        request.since.CopyFrom(_parse_time(args.since))
    if args.until:
        request.until.CopyFrom(_parse_time(args.until))
    found: list[dict[str, Any]] = []
    async with operator_channel(args, _settings().home) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        while len(found) < args.limit:
            response = await stub.ListTransitions(request, timeout=30)
            found += [_as_dict(entry) for entry in response.entries]
            if not response.next_page_token:
                break
            request.page_token = response.next_page_token
    return found[: args.limit]


def cmd_ledger_list(args: argparse.Namespace) -> int:
    """List transitions (or parked proposals by status), newest first."""
    rows = _ledger_query(_list_transitions(args))
    if rows is None:
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return 0
    for row in rows:
        keys = ",".join(row.get("changed_keys", [])) or "-"
        receipt = "  receipt" if row.get("has_receipt") else ""
        print(
            f"{row['at']}  {row.get('status', '-'):<9} {row['thread_id']}@{row.get('version', 0)}"
            f"  {row.get('kind', '-'):<10} {row['digest'][:16]}  {row['node_id']}"
            f"  keys={keys}{receipt}"
        )
    if not rows:
        print("no transitions match")
    return 0


async def _show_transition(args: argparse.Namespace) -> dict[str, Any]:
    request = ledger_pb2.GetTransitionDetailRequest(
        digest=args.digest or "", thread_id=args.thread or "", version=args.version or 0
    )
    async with operator_channel(args, _settings().home) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        return _as_dict(await stub.GetTransitionDetail(request, timeout=30))


def cmd_ledger_show(args: argparse.Namespace) -> int:
    """One committed record with its patch, state (if kept) and receipt."""
    if bool(args.digest) == (args.thread is not None):
        print("ztate ledger show: give DIGEST or --thread and --version", file=sys.stderr)
        return 2
    if args.thread is not None and args.version is None:
        print("ztate ledger show: --thread needs --version", file=sys.stderr)
        return 2
    detail = _ledger_query(_show_transition(args))
    if detail is None:
        return 1
    if args.json:
        print(json.dumps(detail, sort_keys=True))
        return 0
    entry = detail["entry"]
    print(f"{entry['thread_id']}@{entry.get('version', 0)}  {entry.get('kind', '-')}")
    print(f"digest     {entry['digest']}")
    print(f"parent     {entry['parent_digest']}")
    print(f"node       {entry['node_id']}")
    print(f"committed  {entry['at']}")
    print(f"key id     {detail.get('key_id', '-')}  signature {detail.get('signature', '-')}")
    print(f"patch      {detail['patch_json']}")
    state = detail["state_json"] if detail.get("state_kept") else "(pruned)"
    print(f"state      {state}")
    if detail.get("receipt_json"):
        print(f"receipt    {detail['receipt_json']}")
        print(f"           key {detail.get('receipt_key_id', '-')}")
    else:
        print("receipt    none")
    return 0


async def _key_history(args: argparse.Namespace) -> list[dict[str, Any]]:
    request = ledger_pb2.KeyHistoryRequest(
        thread_id=args.thread, key=args.state_key, page_size=1000
    )
    found: list[dict[str, Any]] = []
    async with operator_channel(args, _settings().home) as channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(channel)
        while True:
            response = await stub.KeyHistory(request, timeout=30)
            found += [_as_dict(change) for change in response.changes]
            if not response.next_page_token:
                return found
            request.page_token = response.next_page_token


def cmd_ledger_history(args: argparse.Namespace) -> int:
    """The values one key took across a thread, oldest first."""
    rows = _ledger_query(_key_history(args))
    if rows is None:
        return 1
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return 0
    for row in rows:
        value = "(removed)" if row.get("removed") else row.get("value_json", "")
        print(f"v{row.get('version', 0):<6} {row['committed_at']}  {row['node_id']}  {value}")
    if not rows:
        print(f"{args.state_key} never changed in {args.thread}")
    return 0


def cmd_ledger_prune(args: argparse.Namespace) -> int:
    """Prune old state bodies; every record, digest and signature stays."""
    from datetime import timedelta

    from ztate.services.cli.verify import database_dsn
    from ztate.services.store.retention import Limits, RetentionError, prune
    from ztate.services.verify.checks import VerifyError

    try:
        limits = Limits(
            keep_versions=args.keep_versions,
            older_than=None if args.older_than is None else timedelta(days=args.older_than),
        )
        dsn, _embedded = database_dsn(_settings())
        pruned = asyncio.run(prune(dsn, limits, thread_id=args.thread))
    except (RetentionError, VerifyError) as exc:
        print(f"ztate ledger prune: {exc}", file=sys.stderr)
        return 2
    print(f"pruned {pruned} state bodies; every record, digest and signature is kept")
    return 0


async def _revert(args: argparse.Namespace) -> transition_pb2.RevertThreadResponse:
    request = transition_pb2.RevertThreadRequest(
        thread_id=args.thread,
        to_version=args.to,
        idempotency_key=args.idempotency_key or f"revert-{uuid.uuid4().hex}",
    )
    async with operator_channel(args, _settings().home) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        response: transition_pb2.RevertThreadResponse = await stub.RevertThread(request, timeout=30)
        return response


def cmd_threads_revert(args: argparse.Namespace) -> int:
    """Append a transition restoring an earlier state; history is never rewritten."""
    try:
        response = asyncio.run(_revert(args))
    except grpc.aio.AioRpcError as error:
        print(f"ztate: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return 1
    done = response.transition
    again = " (already done: this idempotency key was used)" if response.replayed else ""
    print(
        f"thread {done.thread_id} reverted to the state of version {args.to}{again}: "
        f"new version {done.version}, digest {done.digest}, by {done.node_id}"
    )
    return 0


Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()
COMMAND_GROUP = "ztate.cli"


def _server_commands() -> list[Callable[[Subparsers[argparse.ArgumentParser]], None]]:
    """The commands the installed services add (``run``, ``serve``, ``approval-serve``, ...).

    The core never imports a server: each service registers its commands under the
    ``ztate.cli`` entry-point group of its distribution (pyproject.toml), found here.
    """
    found = sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name)
    return [entry.load() for entry in found]


def settings_or_exit() -> Settings:
    """The transition service's settings, or exit 2 with what is wrong in them."""
    return _settings()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ztate", description="zero-trust control plane for shared agent state"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for register in _server_commands():
        register(sub)

    ca_parser = sub.add_parser("ca", help="a development certificate authority")
    ca_sub = ca_parser.add_subparsers(dest="ca_command", required=True)
    init = ca_sub.add_parser("init", help="create a CA")
    init.add_argument("--dir", default=".ztate/ca")
    init.add_argument("--trust-domain", default="ztate.local")
    init.add_argument("--days", type=int, default=3650)
    init.set_defaults(func=cmd_ca_init)
    issue = ca_sub.add_parser("issue", help="issue a certificate for one identity")
    issue.add_argument("--role", required=True, choices=[r.value for r in Role])
    issue.add_argument("--name", required=True)
    issue.add_argument("--trust-domain", default="ztate.local")
    issue.add_argument("--ca-dir", default=".ztate/ca")
    issue.add_argument("--out", default=".ztate/certs")
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
    renew.add_argument("--role", choices=[r.value for r in Role], help="with --name, in --out")
    renew.add_argument("--name")
    renew.add_argument("--out", default=".ztate/certs")
    renew.add_argument("--ca-dir", default=".ztate/ca")
    renew.add_argument("--ttl", help="90m, 24h, 7d (default: the old certificate's lifetime)")
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

    keys = sub.add_parser("keys", help="HMAC chain keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    keys_init = keys_sub.add_parser("init", help="write a new keyring file")
    keys_init.add_argument("--file", default=".ztate/keys/hmac-keyring.json")
    keys_init.add_argument("--key-id", default="k1")
    keys_init.set_defaults(func=cmd_keys_init)
    keys_rotate = keys_sub.add_parser("rotate", help="add a new key and make it current")
    keys_rotate.add_argument("--file", default=".ztate/keys/hmac-keyring.json")
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

    policy = sub.add_parser("policy", help="policies")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate a policy file or folder offline")
    check.add_argument("path")
    check.set_defaults(func=cmd_policy_check)
    show = policy_sub.add_parser("show", help="print the effective policy and its digest")
    show.add_argument("path", nargs="?", help="default: ZTATE_POLICY_PATH")
    show.set_defaults(func=cmd_policy_show)
    add_verify_commands(sub)
    add_health_command(sub)
    add_db_commands(sub)

    ledger = sub.add_parser("ledger", help="query and export the ledger")
    ledger_sub = ledger.add_subparsers(dest="ledger_command", required=True)
    rejections = ledger_sub.add_parser("rejections", help="list refused proposals, newest first")
    add_connection_flags(rejections)
    rejections.add_argument("--thread")
    rejections.add_argument("--node", help="full SPIFFE ID")
    rejections.add_argument("--reason", help="e.g. KEY_NOT_WRITABLE")
    rejections.add_argument("--since", help="RFC 3339 time")
    rejections.add_argument("--until", help="RFC 3339 time")
    rejections.add_argument("--limit", type=int, default=50)
    rejections.add_argument("--json", action="store_true", help="one JSON object per line")
    rejections.set_defaults(func=cmd_ledger_rejections)
    listing = ledger_sub.add_parser("list", help="list transitions, newest first")
    add_connection_flags(listing)
    listing.add_argument("--thread")
    listing.add_argument("--node", help="full SPIFFE ID")
    # --key names the client's TLS key (add_connection_flags)
    listing.add_argument(
        "--changed-key", dest="changed_key", help="a top-level key the patch touches"
    )
    listing.add_argument(
        "--status", help="committed (default), or parked: pending, rejected, expired, stale"
    )
    listing.add_argument("--since", help="RFC 3339 time")
    listing.add_argument("--until", help="RFC 3339 time")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(func=cmd_ledger_list)
    show_one = ledger_sub.add_parser(
        "show", help="one record by digest or --thread/--version, with patch, state, receipt"
    )
    add_connection_flags(show_one)
    show_one.add_argument("digest", nargs="?")
    show_one.add_argument("--thread")
    show_one.add_argument("--version", type=int)
    show_one.add_argument("--json", action="store_true", help="one JSON object")
    show_one.set_defaults(func=cmd_ledger_show)
    history = ledger_sub.add_parser("history", help="the values one key took across a thread")
    add_connection_flags(history)
    history.add_argument("thread")
    # dest "key" is the client's TLS key (add_connection_flags)
    history.add_argument("state_key", metavar="KEY", help="a top-level key of the state")
    history.add_argument("--json", action="store_true", help="one JSON object per line")
    history.set_defaults(func=cmd_ledger_history)
    add_export_command(ledger_sub)
    prune = ledger_sub.add_parser(
        "prune", help="drop old state bodies (records, digests and signatures stay)"
    )
    prune.add_argument("--keep-versions", type=int, help="keep the newest N state bodies")
    prune.add_argument("--older-than", type=float, help="prune bodies older than DAYS")
    prune.add_argument("--thread", help="one thread only (default: every thread)")
    prune.set_defaults(func=cmd_ledger_prune)

    threads = sub.add_parser("threads", help="operate on threads")
    threads_sub = threads.add_subparsers(dest="threads_command", required=True)
    add_thread_commands(threads_sub, ledger_sub)
    revert = threads_sub.add_parser(
        "revert", help="append a transition restoring the state of an earlier version"
    )
    revert.add_argument("thread")
    revert.add_argument("--to", type=int, required=True, metavar="VERSION")
    revert.add_argument("--idempotency-key", help="default: a new random key")
    add_connection_flags(revert)
    revert.set_defaults(func=cmd_threads_revert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
