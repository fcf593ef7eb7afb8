"""``ztate approval-serve`` and ``ztate approvals ...``: the approval service's commands.

Reviewers list and read reviews and decide on them with their own certificate
(``$ZTATE_HOME/certs/reviewer-<name>.*`` by default): the service knows who
decided from that certificate alone, so there is no ``--as`` flag to trust.
Where they connect comes from the one connection context of every client command
(services/cli/context.py: flags, ``ZTATE_APPROVAL_ADDRESS`` and ``ZTATE_CERT``/``KEY``/
``CA``, the context file, ``ZTATE_APPROVAL_LISTEN``). Exit codes, as every command's
(docs/cli.md): 0 done, 1 refused or failed (the reason code and message go to stderr),
2 wrong usage or unreadable credentials, 3 no such review, 4 unreachable.

Only argparse at import time: gRPC and the protos load when a command runs.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ztate.services.cli.context import APPROVAL, add_connection_flags, run_client
from ztate.services.cli.output import (
    OK,
    USAGE,
    Column,
    add_output_flag,
    dumps,
    emit_list,
    emit_one,
    rpc_error,
    set_log_level,
    shown,
    shown_lines,
    usage,
)
from ztate.services.cli.resources import malformed, paged, reply_json, reply_time

if TYPE_CHECKING:
    from ztate.v1 import approval_pb2, approval_pb2_grpc

DIGEST = re.compile(r"^[0-9a-f]{64}\Z")
PAGE_SIZE = 100
CALL_TIMEOUT_SECONDS = 30.0
REFUSED = 1
STATUSES = ("open", "approved", "rejected", "expired")
STATUS_ALIASES = {"pending": "open"}  # the ledger's word for a parked proposal

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()


def status_value(name: str) -> int:
    """A review status name (``open``, ``pending``, ...) as the protocol's number."""
    from ztate.v1 import approval_pb2

    name = STATUS_ALIASES.get(name, name)
    value: int = approval_pb2.ReviewStatus.Value(f"REVIEW_STATUS_{name.upper()}")
    return value


def status_name(value: int) -> str:
    from ztate.v1 import approval_pb2

    name: str = approval_pb2.ReviewStatus.Name(value).removeprefix("REVIEW_STATUS_").lower()
    return name if name in STATUSES else "unspecified"


# --- serving ----------------------------------------------------------------------------


def cmd_approval_serve(args: argparse.Namespace) -> int:
    """Run the approval service from configuration (``ZTATE_APPROVAL_*``) until signalled."""
    from pydantic import ValidationError

    from ztate.approval_service.app import serve
    from ztate.services.cli.startup import run_service
    from ztate.services.runtime.config import ApprovalSettings
    from ztate.services.runtime.telemetry import configure_logging

    try:
        settings = ApprovalSettings()
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or 'settings'}: {err['msg']}"
            for err in exc.errors()
        )
        print(f"ztate: invalid approval configuration: {problems}", file=sys.stderr)
        return USAGE
    configure_logging(settings.log_format)
    set_log_level(args.log_level)
    dsn = settings.database_url.get_secret_value() if settings.database_url else None
    return run_service(
        lambda started: serve(settings, started=started),
        dsn=dsn,
        wait_seconds=args.wait_for_database,
        prefix="cannot start the approval service",
        stopped="the approval service stopped",
    )


# --- the reviewer's client --------------------------------------------------------------


def _digest(text: str) -> str:
    if not DIGEST.match(text):
        usage("DIGEST must be the 64 lower-case hex characters of a transition digest")
    return text


Call = Callable[["approval_pb2_grpc.ApprovalServiceStub"], Awaitable[int]]


def _run(args: argparse.Namespace, call: Call) -> int:
    """Connect, make the call, and turn failures into exit codes."""
    import grpc

    from ztate.v1 import approval_pb2_grpc

    async def connected(channel: Any) -> int:
        try:
            return await call(approval_pb2_grpc.ApprovalServiceStub(channel))
        except grpc.aio.AioRpcError as error:
            from ztate.approval_service.delivery import refusal_reason

            raise rpc_error(error, reason=refusal_reason(error)) from None

    return run_client(args, connected, APPROVAL)


def review_dict(review: approval_pb2.Review) -> dict[str, Any]:
    """A review as plain JSON, with its diff and receipt parsed."""
    found: dict[str, Any] = {
        "digest": review.digest,
        "status": status_name(review.status),
        "thread_id": review.thread_id,
        "base_version": review.base_version,
        "node_id": review.node_id,
        "risk_rules": list(review.risk_rules),
        "required_approvals": review.required_approvals,
        "approvers": list(review.approvers),
        "opened_at": reply_time(review.opened_at, "opened_at"),
        "expires_at": reply_time(review.expires_at, "expires_at"),
        "redacted_diff": reply_json(review.redacted_diff_json or b"{}", "redacted_diff_json"),
        "outcome": review.outcome or None,
    }
    if review.HasField("receipt"):
        receipt = reply_json(review.receipt.receipt_json, "receipt_json")
        if not isinstance(receipt, dict):
            raise malformed("receipt_json is not a JSON object")
        found["receipt"] = {
            "receipt": receipt,
            "signature": review.receipt.signature,
            "key_id": review.receipt.key_id,
        }
    return found


def _compact(value: Any) -> str:
    return dumps(value, indent=None)  # escapes what a terminal would act on or reorder


def diff_lines(diff: Any) -> list[str]:
    """The redacted diff, one changed key at a time: ``-`` old value, ``+`` new value."""
    changes = diff.get("changes") if isinstance(diff, dict) else None
    if not isinstance(changes, dict):
        return dumps(diff).splitlines()
    lines: list[str] = []
    for key, change in sorted(changes.items()):
        lines.append(f"  {key}")
        if isinstance(change, dict):
            old = _compact(change["old"]) if "old" in change else "(absent)"
            new = _compact(change["new"]) if "new" in change else "(removed)"
            lines += [f"    - {old}", f"    + {new}"]
        else:
            lines.append(f"    {_compact(change)}")
    return lines


def _progress(review: dict[str, Any]) -> str:
    return f"{len(review['approvers'])}/{review['required_approvals']}"


def review_text(review: dict[str, Any]) -> str:
    lines = [
        f"review        {review['digest']}",
        f"status        {review['status']} ({_progress(review)} approvals)",
        f"thread        {review['thread_id']} at base version {review['base_version']}",
        f"proposed by   {review['node_id']}",
        f"risk rules    {', '.join(review['risk_rules']) or '-'}",
        f"approvals     {review['required_approvals']} required",
        f"approvers     {', '.join(review['approvers']) or '-'}",
        f"opened        {review['opened_at']}, expires {review['expires_at']}",
    ]
    if "receipt" in review:
        receipt = review["receipt"]["receipt"]
        reviewers = receipt.get("reviewers")
        lines.append(
            f"receipt       {receipt.get('decision')} by "
            f"{', '.join(map(str, reviewers)) if isinstance(reviewers, list) else reviewers}; "
            f"nonce {receipt.get('nonce')}, key {receipt.get('key_id')}, valid until "
            f"{receipt.get('expires_at')}"
        )
    if review.get("outcome"):
        lines.append(f"outcome       {_outcome_text(review['outcome'])}")
    lines.append("changes (derived from the proposal and its base; sensitive values are keyed")
    lines.append("digests the approval service computes: equal values show equal digests):")
    lines += diff_lines(review["redacted_diff"])
    return shown_lines(lines)  # thread, node, approvers, rules, keys: as the server sent them


def print_review(review: dict[str, Any]) -> None:
    print(review_text(review))


REVIEW_COLUMNS: list[Column] = [
    ("digest", lambda r: r["digest"]),
    ("status", lambda r: r["status"]),
    ("approvals", _progress),
    ("thread", lambda r: r["thread_id"]),
    ("base", lambda r: r["base_version"]),
    ("node", lambda r: r["node_id"]),
    ("rules", lambda r: r["risk_rules"]),
]


def cmd_list(args: argparse.Namespace) -> int:
    """List reviews (open ones by default): oldest open first, decided ones newest first."""
    from ztate.v1 import approval_pb2

    reviews: list[dict[str, Any]] = []

    async def call(stub: approval_pb2_grpc.ApprovalServiceStub) -> int:
        request = approval_pb2.ListReviewsRequest(
            status=status_value(args.status), thread_id=args.thread or "", page_size=PAGE_SIZE
        )
        reviews.extend(
            await paged(stub.ListReviews, request, lambda r: r.reviews, args.limit, review_dict)
        )
        return OK

    code = _run(args, call)
    status = STATUS_ALIASES.get(args.status, args.status)
    emit_list(reviews[: args.limit], args.output, REVIEW_COLUMNS, empty=f"no {status} reviews")
    return code


def cmd_show(args: argparse.Namespace) -> int:
    """Show one review: the redacted diff and everything the decision binds to."""
    from ztate.v1 import approval_pb2

    digest = _digest(args.digest)
    shown: list[dict[str, Any]] = []

    async def call(stub: approval_pb2_grpc.ApprovalServiceStub) -> int:
        request = approval_pb2.GetReviewRequest(digest=digest)
        response = await stub.GetReview(request, timeout=CALL_TIMEOUT_SECONDS)
        shown.append(review_dict(response.review))
        return OK

    code = _run(args, call)
    emit_one(shown[0], args.output, review_text)
    return code


def _decide(args: argparse.Namespace, approve: bool, verb: str) -> int:
    from ztate.v1 import approval_pb2

    digest = _digest(args.digest)
    decision = approval_pb2.DECISION_APPROVE if approve else approval_pb2.DECISION_REJECT

    async def call(stub: approval_pb2_grpc.ApprovalServiceStub) -> int:
        request = approval_pb2.DecideRequest(digest=digest, decision=decision)
        response = await stub.Decide(request, timeout=CALL_TIMEOUT_SECONDS)
        review = review_dict(response.review)
        if review["status"] == "open":
            print(
                shown(
                    f"{verb} {review['digest']}: {_progress(review)} approvals, "
                    "waiting for more reviewers"
                )
            )
        else:
            nonce = review.get("receipt", {}).get("receipt", {}).get("nonce", "-")
            print(
                shown(
                    f"{verb} {review['digest']}: review {review['status']}, receipt nonce {nonce}"
                )
            )
            outcome = await _delivered(stub, review["digest"], args.wait)
            print(shown(f"  the transition service: {_outcome_text(outcome)}"))
            expected = "committed" if approve else "rejected"
            if outcome not in (None, expected):
                return REFUSED  # decided, but it did not take effect: say so by the exit code
        return OK

    return _run(args, call)


async def _delivered(
    stub: approval_pb2_grpc.ApprovalServiceStub, digest: str, within: float
) -> str | None:
    """What the transition service did with the decision, once delivered (None: not yet
    within ``within`` seconds; it is delivered in the background and shown by ``show``)."""
    import asyncio

    from ztate.v1 import approval_pb2

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        got = await stub.GetReview(
            approval_pb2.GetReviewRequest(digest=digest), timeout=CALL_TIMEOUT_SECONDS
        )
        if got.review.outcome or loop.time() >= deadline:
            return got.review.outcome or None
        await asyncio.sleep(0.2)  # polling the review's delivery, bounded by ``within``


def _outcome_text(outcome: str | None) -> str:
    if outcome is None:
        return "not delivered yet (see `ztate approvals show`)"
    if outcome == "stale":
        return "stale: the thread moved on before the decision arrived; nothing was committed"
    if outcome.startswith("refused"):
        return f"{outcome}: the policy in force no longer allows this change; nothing committed"
    return outcome


def cmd_approve(args: argparse.Namespace) -> int:
    """Approve the transition with this digest."""
    return _decide(args, True, "approved")


def cmd_reject(args: argparse.Namespace) -> int:
    """Reject the transition with this digest."""
    return _decide(args, False, "rejected")


def add_reviewer_flags(parser: argparse.ArgumentParser) -> None:
    """The connection flags (services/cli/context.py) and ``--reviewer``."""
    parser.add_argument(
        "--reviewer",
        metavar="NAME",
        help="use $ZTATE_HOME/certs/reviewer-NAME.crt/.key (the development layout; "
        "default: the context's certificate, else reviewer-alice)",
    )
    add_connection_flags(parser, APPROVAL)


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``approval-serve`` and ``approvals`` to the ``ztate`` command."""
    from ztate.services.cli.main import group

    serve = subparsers.add_parser(
        "approval-serve", help="run the approval service from configuration"
    )
    add_service_flags(serve)
    serve.set_defaults(func=cmd_approval_serve)

    commands = group(subparsers, "approvals", "review risky transitions")

    listing = commands.add_parser("list", help="list reviews, open ones by default")
    listing.add_argument(
        "--status",
        choices=(*STATUSES, *STATUS_ALIASES),
        default="open",
        help="open (= pending, default), approved, rejected, expired",
    )
    listing.add_argument("--thread", help="only reviews of this thread")
    listing.add_argument("--limit", type=int, default=1000, help="at most this many")
    add_output_flag(listing)
    add_reviewer_flags(listing)
    listing.set_defaults(func=cmd_list)

    show = commands.add_parser("show", help="show a review and its redacted diff")
    show.add_argument("digest", metavar="DIGEST", help="the transition digest under review")
    add_output_flag(show)
    add_reviewer_flags(show)
    show.set_defaults(func=cmd_show)

    for name, func, text in (
        ("approve", cmd_approve, "approve the transition with this digest"),
        ("reject", cmd_reject, "reject the transition with this digest"),
    ):
        decide = commands.add_parser(name, help=text)
        decide.add_argument("digest", metavar="DIGEST", help="the transition digest you reviewed")
        decide.add_argument(
            "--wait",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="how long to wait for what the transition service did (default %(default)s)",
        )
        add_reviewer_flags(decide)
        decide.set_defaults(func=func)


def add_service_flags(parser: argparse.ArgumentParser, *, log_level: str = "info") -> None:
    """The flags of the commands that run a service: ``--wait-for-database`` and
    ``--log-level``."""
    from ztate.services.store.waiting import wait_default

    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=log_level,
        help="the least severe log line shown (default %(default)s)",
    )
    parser.add_argument(
        "--wait-for-database",
        type=float,
        default=wait_default(),
        metavar="SECONDS",
        help="how long to wait, with backoff, for a database that is not up yet "
        "(env ZTATE_DATABASE_WAIT_SECONDS; default %(default)s; 0: do not wait)",
    )
