"""``ztate approval-serve`` and ``ztate approvals ...``: the approval service's commands.

Reviewers list and read reviews and decide on them with their own certificate
(``$ZTATE_HOME/certs/reviewer-<name>.*`` by default): the service knows who
decided from that certificate alone, so there is no ``--as`` flag to trust.
Exit codes: 0 done, 1 refused or failed (the reason code and message go to
stderr), 2 wrong usage or unreadable credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from pydantic import ValidationError

from ztate.services.runtime.config import ApprovalSettings
from ztate.v1 import approval_pb2, approval_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:7444"
DEFAULT_REVIEWER = "alice"
DIGEST = re.compile(r"^[0-9a-f]{64}\Z")
PAGE_SIZE = 100
CALL_TIMEOUT_SECONDS = 30.0
OK, REFUSED, USAGE = 0, 1, 2

STATUS_NAMES = {
    "open": approval_pb2.REVIEW_STATUS_OPEN,
    "approved": approval_pb2.REVIEW_STATUS_APPROVED,
    "rejected": approval_pb2.REVIEW_STATUS_REJECTED,
    "expired": approval_pb2.REVIEW_STATUS_EXPIRED,
}
STATUS_OF = {value: name for name, value in STATUS_NAMES.items()}

Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()


class UsageError(Exception):
    """The command line or the credentials it names are unusable."""


# --- serving ----------------------------------------------------------------------------


def cmd_approval_serve(_: argparse.Namespace) -> int:
    """Run the approval service from configuration (``ZTATE_APPROVAL_*``) until signalled."""
    from ztate.approval_service.app import serve
    from ztate.contract.errors import KeyFileError
    from ztate.services.runtime.telemetry import configure_logging
    from ztate.services.store.migrate import MigrationError

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
    try:
        asyncio.run(serve(settings))
    except (KeyFileError, MigrationError, OSError, ValueError) as exc:
        print(f"ztate: cannot start the approval service: {exc}", file=sys.stderr)
        return USAGE
    return OK


# --- the reviewer's client --------------------------------------------------------------


def _home() -> Path:
    return Path(os.environ.get("ZTATE_HOME", ".ztate"))


def reviewer_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """An mTLS channel to the approval service with the reviewer's certificate."""
    from ztate.approval_service.app import MAX_MESSAGE_BYTES

    certs = _home() / "certs"
    stem = f"reviewer-{args.reviewer}"
    cert = Path(args.cert) if args.cert else certs / f"{stem}.crt"
    key = Path(args.key) if args.key else certs / f"{stem}.key"
    ca = Path(args.ca) if args.ca else certs / "ca.crt"
    try:
        credentials = grpc.ssl_channel_credentials(
            ca.read_bytes(), key.read_bytes(), cert.read_bytes()
        )
    except OSError as exc:
        raise UsageError(f"cannot read credentials: {exc.filename}: {exc.strerror}") from None
    options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if args.server_name:
        options.append(("grpc.ssl_target_name_override", args.server_name))
    return grpc.aio.secure_channel(args.target, credentials, options=options)


def _digest(text: str) -> str:
    if not DIGEST.match(text):
        raise UsageError("DIGEST must be the 64 lower-case hex characters of a transition digest")
    return text


Call = Callable[[approval_pb2_grpc.ApprovalServiceStub], Awaitable[int]]


def _run(args: argparse.Namespace, call: Call) -> int:
    """Connect, make the call, and turn failures into exit codes."""
    from ztate.approval_service.delivery import refusal_reason

    async def connected() -> int:
        async with reviewer_channel(args) as channel:
            return await call(approval_pb2_grpc.ApprovalServiceStub(channel))

    try:
        return asyncio.run(connected())
    except UsageError as exc:
        print(f"ztate: {exc}", file=sys.stderr)
        return USAGE
    except grpc.aio.AioRpcError as error:
        print(f"ztate: {refusal_reason(error)}: {error.details()}", file=sys.stderr)
        return REFUSED


def review_dict(review: approval_pb2.Review) -> dict[str, Any]:
    """A review as plain JSON, with its diff and receipt parsed."""
    found: dict[str, Any] = {
        "digest": review.digest,
        "status": STATUS_OF.get(review.status, "unspecified"),
        "thread_id": review.thread_id,
        "base_version": review.base_version,
        "node_id": review.node_id,
        "risk_rules": list(review.risk_rules),
        "required_approvals": review.required_approvals,
        "approvers": list(review.approvers),
        "opened_at": review.opened_at.ToJsonString(),
        "expires_at": review.expires_at.ToJsonString(),
        "redacted_diff": json.loads(review.redacted_diff_json or b"{}"),
        "outcome": review.outcome or None,
    }
    if review.HasField("receipt"):
        found["receipt"] = {
            "receipt": json.loads(review.receipt.receipt_json),
            "signature": review.receipt.signature,
            "key_id": review.receipt.key_id,
        }
    return found


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def diff_lines(diff: Any) -> list[str]:
    """The redacted diff, one changed key at a time: ``-`` old value, ``+`` new value."""
    changes = diff.get("changes") if isinstance(diff, dict) else None
    if not isinstance(changes, dict):
        return json.dumps(diff, indent=2, sort_keys=True, ensure_ascii=False).splitlines()
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


def print_review(review: dict[str, Any]) -> None:
    print(f"review        {review['digest']}")
    print(f"status        {review['status']} ({_progress(review)} approvals)")
    print(f"thread        {review['thread_id']} at base version {review['base_version']}")
    print(f"proposed by   {review['node_id']}")
    print(f"risk rules    {', '.join(review['risk_rules']) or '-'}")
    print(f"approvals     {review['required_approvals']} required")
    print(f"approvers     {', '.join(review['approvers']) or '-'}")
    print(f"opened        {review['opened_at']}, expires {review['expires_at']}")
    if "receipt" in review:
        receipt = review["receipt"]["receipt"]
        print(
            f"receipt       {receipt['decision']} by {', '.join(receipt['reviewers'])}; "
            f"nonce {receipt['nonce']}, key {receipt['key_id']}, valid until "
            f"{receipt['expires_at']}"
        )
    if review.get("outcome"):
        print(f"outcome       {_outcome_text(review['outcome'])}")
    print("changes (derived from the proposal and its base; sensitive values are keyed")
    print("digests the approval service computes: equal values show equal digests):")
    for line in diff_lines(review["redacted_diff"]):
        print(line)


def cmd_list(args: argparse.Namespace) -> int:
    """List reviews (open ones by default): oldest open first, decided ones newest first."""

    async def call(stub: approval_pb2_grpc.ApprovalServiceStub) -> int:
        request = approval_pb2.ListReviewsRequest(
            status=STATUS_NAMES[args.status], thread_id=args.thread or "", page_size=PAGE_SIZE
        )
        reviews: list[dict[str, Any]] = []
        while True:
            response = await stub.ListReviews(request, timeout=CALL_TIMEOUT_SECONDS)
            reviews += [review_dict(review) for review in response.reviews]
            if not response.next_page_token or len(reviews) >= args.limit:
                break
            request.page_token = response.next_page_token
        for review in reviews[: args.limit]:
            if args.json:
                print(json.dumps(review, sort_keys=True))
            else:
                print(
                    f"{review['digest']}  {review['status']:<8} {_progress(review):>5}  "
                    f"{review['thread_id']}@{review['base_version']}  {review['node_id']}  "
                    f"rules={','.join(review['risk_rules']) or '-'}"
                )
        if not reviews and not args.json:
            print(f"no {args.status} reviews")
        return OK

    return _run(args, call)


def cmd_show(args: argparse.Namespace) -> int:
    """Show one review: the redacted diff and everything the decision binds to."""

    async def call(stub: approval_pb2_grpc.ApprovalServiceStub) -> int:
        request = approval_pb2.GetReviewRequest(digest=_digest(args.digest))
        response = await stub.GetReview(request, timeout=CALL_TIMEOUT_SECONDS)
        review = review_dict(response.review)
        if args.json:
            print(json.dumps(review, sort_keys=True, indent=2))
        else:
            print_review(review)
        return OK

    return _run(args, call)


def _decide(args: argparse.Namespace, decision: int, verb: str) -> int:
    async def call(stub: approval_pb2_grpc.ApprovalServiceStub) -> int:
        request = approval_pb2.DecideRequest(digest=_digest(args.digest), decision=decision)
        response = await stub.Decide(request, timeout=CALL_TIMEOUT_SECONDS)
        review = review_dict(response.review)
        if review["status"] == "open":
            print(
                f"{verb} {review['digest']}: {_progress(review)} approvals, "
                "waiting for more reviewers"
            )
        else:
            nonce = review.get("receipt", {}).get("receipt", {}).get("nonce", "-")
            print(f"{verb} {review['digest']}: review {review['status']}, receipt nonce {nonce}")
            outcome = await _delivered(stub, review["digest"], args.wait)
            print(f"  the transition service: {_outcome_text(outcome)}")
            expected = "committed" if decision == approval_pb2.DECISION_APPROVE else "rejected"
            if outcome not in (None, expected):
                return REFUSED  # decided, but it did not take effect: say so by the exit code
        return OK

    return _run(args, call)


async def _delivered(
    stub: approval_pb2_grpc.ApprovalServiceStub, digest: str, within: float
) -> str | None:
    """What the transition service did with the decision, once delivered (None: not yet
    within ``within`` seconds; it is delivered in the background and shown by ``show``)."""
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
    return _decide(args, approval_pb2.DECISION_APPROVE, "approved")


def cmd_reject(args: argparse.Namespace) -> int:
    """Reject the transition with this digest."""
    return _decide(args, approval_pb2.DECISION_REJECT, "rejected")


def add_reviewer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="host:port of the service")
    parser.add_argument(
        "--reviewer",
        default=DEFAULT_REVIEWER,
        help="picks $ZTATE_HOME/certs/reviewer-<name>.crt/.key (default %(default)s)",
    )
    parser.add_argument("--cert", help="reviewer certificate (PEM)")
    parser.add_argument("--key", help="reviewer private key (PEM)")
    parser.add_argument("--ca", help="CA certificate (PEM)")
    parser.add_argument("--server-name", help="expected server name, if not the target host")


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``approval-serve`` and ``approvals`` to the ``ztate`` command."""
    subparsers.add_parser(
        "approval-serve", help="run the approval service from configuration"
    ).set_defaults(func=cmd_approval_serve)

    approvals = subparsers.add_parser("approvals", help="review risky transitions")
    commands = approvals.add_subparsers(dest="approvals_command", required=True)

    listing = commands.add_parser("list", help="list reviews, open ones by default")
    add_reviewer_flags(listing)
    listing.add_argument("--status", choices=sorted(STATUS_NAMES), default="open")
    listing.add_argument("--thread", help="only reviews of this thread")
    listing.add_argument("--limit", type=int, default=1000, help="at most this many")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(func=cmd_list)

    show = commands.add_parser("show", help="show a review and its redacted diff")
    add_reviewer_flags(show)
    show.add_argument("digest", metavar="DIGEST")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_show)

    for name, func, text in (
        ("approve", cmd_approve, "approve the transition with this digest"),
        ("reject", cmd_reject, "reject the transition with this digest"),
    ):
        decide = commands.add_parser(name, help=text)
        add_reviewer_flags(decide)
        decide.add_argument("digest", metavar="DIGEST", help="the transition digest you reviewed")
        decide.add_argument(
            "--wait",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="how long to wait for what the transition service did (default %(default)s)",
        )
        decide.set_defaults(func=func)
