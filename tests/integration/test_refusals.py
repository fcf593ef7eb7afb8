"""Every refused proposal: the precise error, and nothing committed.

Each test snapshots the thread's head and ledger before the call and asserts they
are unchanged after it; refusals by an authenticated node are also recorded in
the rejections ledger with their reason code and a digest of the refused bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from tests.conftest import POLICY, TEST_MAX_PATCH_BYTES
from tests.harness import INITIAL, Ledger, Pki, act, client, new_thread_id
from ztate.services.policy.model import Policy
from ztate.worker_sdk import (
    InvalidRequest,
    NotFound,
    PatchTooLarge,
    PermissionDenied,
    StaleVersion,
    ZtateClient,
    ZtateError,
)

PARSER_LIMIT = Policy.load(POLICY).max_patch_bytes("input-parser")


@pytest_asyncio.fixture
async def thread_id(target: str, pki: Pki) -> str:
    thread = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread, INITIAL, policy="pipeline")
    return thread


@pytest_asyncio.fixture
async def parser(target: str, pki: Pki) -> AsyncIterator[ZtateClient]:
    async with client(target, pki.node("input-parser")) as worker:
        yield worker


async def refused(
    ledger: Ledger, thread_id: str, call: object, expected: type[ZtateError], reason: str
) -> ZtateError:
    """Run ``call``; assert it raised ``expected`` with ``reason`` and changed nothing."""
    before = await ledger.snapshot(thread_id)
    with pytest.raises(expected) as caught:
        await call  # type: ignore[misc]
    assert caught.value.reason == reason, caught.value
    assert await ledger.snapshot(thread_id) == before
    return caught.value


async def test_stale_version_returns_the_head_and_commits_nothing(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    await parser.propose(thread_id, 0, {"requested_action": act("first")})
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, {"requested_action": act("late")}),
        StaleVersion,
        "STALE_VERSION",
    )
    assert error.code == grpc.StatusCode.ABORTED
    assert error.current_version == 1
    [row] = await ledger.rejections(thread_id)
    assert (row["reason"], row["base_version"]) == ("STALE_VERSION", 0)


async def test_version_from_the_future_is_stale(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 7, {"requested_action": act("x")}),
        StaleVersion,
        "STALE_VERSION",
    )
    assert error.current_version == 0


async def test_unknown_thread(parser: ZtateClient, ledger: Ledger) -> None:
    missing = new_thread_id()
    error = await refused(
        ledger,
        missing,
        parser.propose(missing, 0, {"requested_action": act("x")}),
        NotFound,
        "THREAD_NOT_FOUND",
    )
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert (await ledger.snapshot(missing)).transitions == 0


async def test_key_outside_the_write_allowlist_refuses_the_whole_patch(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    patch = {
        "requested_action": act("refund"),
        "execution_permissions": ["admin"],
        "target_user_id": "attacker",
    }
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        PermissionDenied,
        "KEY_NOT_WRITABLE",
    )
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert error.keys == ("execution_permissions", "target_user_id")
    [row] = await ledger.rejections(thread_id)
    assert row["reason"] == "KEY_NOT_WRITABLE"
    assert list(row["keys"]) == ["execution_permissions", "target_user_id"]
    assert row["node_id"] == "spiffe://ztate.test/node/input-parser"
    assert row["patch_digest"] is not None
    assert "attacker" not in row["message"]


@pytest.mark.parametrize(
    ("patch", "fragment"),
    [
        (b'{"requested_action": {"action": "refund"}', "not valid JSON"),
        (b'["requested_action"]', "must be a JSON object"),
        (
            b'{"requested_action": {"action": "refund"}, "requested_action": {"action": "none"}}',
            "duplicate member name",
        ),
        (b'{"requested_action": {"action": "\xff\xfe"}}', "not valid UTF-8"),
        (b'{"requested_action": {"action": "\\ud800"}}', "lone surrogate"),
        (b"", "not valid JSON"),
    ],
    ids=["truncated", "array", "duplicate-key", "not-utf8", "lone-surrogate", "empty"],
)
async def test_malformed_patch(
    parser: ZtateClient, thread_id: str, ledger: Ledger, patch: bytes, fragment: str
) -> None:
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        InvalidRequest,
        "PATCH_MALFORMED",
    )
    assert fragment in error.message
    [row] = await ledger.rejections(thread_id)
    assert row["patch_digest"] == hashlib.sha256(patch).hexdigest()


@pytest.mark.parametrize(
    "patch",
    [
        b'{"requested_action": 9007199254740992}',
        b'{"requested_action": -9007199254740992}',
        b'{"requested_action": 1e400}',
        b'{"requested_action": NaN}',
        b'{"requested_action": -Infinity}',
        b'{"requested_action": ' + b"[" * 40 + b"]" * 40 + b"}",
        b'{"requested_action": 1e20}',
        b'{"requested_action": 1e-400}',
        b'{"requested_action": ' + b"7" * 4000 + b"}",
    ],
    ids=["2^53", "-2^53", "1e400", "NaN", "-Infinity", "too-deep", "1e20", "underflow", "digits"],
)
async def test_numbers_outside_ijson_and_deep_nesting(
    parser: ZtateClient, thread_id: str, ledger: Ledger, patch: bytes
) -> None:
    await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        InvalidRequest,
        "VALUE_OUT_OF_RANGE",
    )


async def test_largest_safe_integer_passes_the_parser_and_meets_the_schema(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    patch = b'{"requested_action": {"action": "refund", "amount_cents": 9007199254740991}}'
    error = await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, patch),
        InvalidRequest,
        "SCHEMA_VIOLATION",
    )
    assert "requested_action.amount_cents" in error.message


@pytest.mark.parametrize(
    ("node", "limit"),
    [("input-parser", PARSER_LIMIT), ("planner", TEST_MAX_PATCH_BYTES)],
    ids=["node-limit-from-policy", "service-limit"],
)
async def test_oversized_patch_is_refused_before_parsing(
    target: str, pki: Pki, thread_id: str, ledger: Ledger, node: str, limit: int
) -> None:
    # Not JSON at all: only a size check that runs before the parser can name it.
    patch = b"{" * (limit + 1)
    async with client(target, pki.node(node)) as worker:
        error = await refused(
            ledger,
            thread_id,
            worker.propose(thread_id, 0, patch),
            PatchTooLarge,
            "PATCH_TOO_LARGE",
        )
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.limit == limit
    [row] = await ledger.rejections(thread_id)
    assert row["patch_bytes"] == limit + 1


async def test_patch_at_the_limit_is_parsed(parser: ZtateClient, thread_id: str) -> None:
    body = b'{"requested_action": {"action": "none"}'
    patch = body + b" " * (PARSER_LIMIT - len(body) - 1) + b"}"
    assert len(patch) == PARSER_LIMIT
    committed = await parser.propose(thread_id, 0, patch)
    assert committed.version == 1


async def test_reused_idempotency_key_for_another_request(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    await parser.propose(thread_id, 0, {"requested_action": act("a")}, idempotency_key="same")
    await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 0, {"requested_action": act("b")}, idempotency_key="same"),
        InvalidRequest,
        "IDEMPOTENCY_KEY_REUSED",
    )


async def test_reused_idempotency_key_at_the_current_head(
    parser: ZtateClient, thread_id: str, ledger: Ledger
) -> None:
    """The key is taken even when the new request's base is the head."""
    await parser.propose(thread_id, 0, {"requested_action": act("a")}, idempotency_key="again")
    await refused(
        ledger,
        thread_id,
        parser.propose(thread_id, 1, {"requested_action": act("b")}, idempotency_key="again"),
        InvalidRequest,
        "IDEMPOTENCY_KEY_REUSED",
    )


@pytest.mark.parametrize(
    ("thread", "version", "key", "fragment"),
    [
        ("bad id with spaces", 0, "k", "thread_id"),
        ("x" * 129, 0, "k", "thread_id"),
        (None, -1, "k", "expected_version"),
        (None, 0, "", "idempotency_key"),
        (None, 0, "k" * 129, "idempotency_key"),
    ],
    ids=["thread-chars", "thread-length", "negative-version", "empty-key", "long-key"],
)
async def test_invalid_request_fields(
    parser: ZtateClient,
    thread_id: str,
    ledger: Ledger,
    thread: str | None,
    version: int,
    key: str,
    fragment: str,
) -> None:
    call = parser._stub.ProposeTransition  # raw stub: the SDK would fill an empty key
    from ztate.v1 import transition_pb2

    request = transition_pb2.ProposeTransitionRequest(
        thread_id=thread or thread_id,
        expected_version=version,
        patch_json=b'{"requested_action": {"action": "none"}}',
        idempotency_key=key,
    )
    before = await ledger.snapshot(thread_id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (caught.value.details() or "")
    assert await ledger.snapshot(thread_id) == before


async def test_empty_patch(parser: ZtateClient, thread_id: str, ledger: Ledger) -> None:
    await refused(
        ledger, thread_id, parser.propose(thread_id, 0, {}), InvalidRequest, "REQUEST_INVALID"
    )


async def test_thread_id_taken(target: str, pki: Pki, thread_id: str, ledger: Ledger) -> None:
    async with client(target, pki.operator()) as operator:
        error = await refused(
            ledger,
            thread_id,
            operator.create_thread(thread_id, {"raw_text": "other"}, policy="pipeline"),
            ZtateError,
            "THREAD_EXISTS",
        )
    assert error.code == grpc.StatusCode.ALREADY_EXISTS


async def test_creating_a_thread_again_as_its_creator_answers_its_genesis(
    target: str, pki: Pki, thread_id: str, ledger: Ledger
) -> None:
    """A CreateThread retried after its reply was lost (the SDK retries it) is answered
    the genesis it created, not THREAD_EXISTS; the same id, state and policy from another
    operator, or with another policy, is still THREAD_EXISTS. Nothing new is written.
    The answer to the repeat says so (``replayed``); a creation does not."""
    before = await ledger.snapshot(thread_id)
    async with client(target, pki.operator()) as operator:
        first = await operator.get_transition(thread_id=thread_id, version=0)
        again = await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        fresh = await operator.create_thread(new_thread_id(), INITIAL, policy="pipeline")
        with pytest.raises(ZtateError) as other_policy:
            await operator.create_thread(thread_id, {"invoice_note": "n"}, policy="billing")
    async with client(target, pki.operator("other-admin")) as other:
        with pytest.raises(ZtateError) as other_operator:
            await other.create_thread(thread_id, INITIAL, policy="pipeline")
    assert (again.version, again.digest, again.record_json) == (0, first.digest, first.record_json)
    assert (again.replayed, fresh.replayed) == (True, False)
    assert other_operator.value.reason == "THREAD_EXISTS"
    assert other_operator.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert other_policy.value.reason == "THREAD_EXISTS"
    assert await ledger.snapshot(thread_id) == before


async def test_initial_state_with_undeclared_key(target: str, pki: Pki, ledger: Ledger) -> None:
    thread = new_thread_id()
    async with client(target, pki.operator()) as operator:
        error = await refused(
            ledger,
            thread,
            operator.create_thread(thread, {"raw_text": "x", "is_admin": True}, policy="pipeline"),
            InvalidRequest,
            "KEY_UNKNOWN",
        )
    assert error.keys == ("is_admin",)
    assert (await ledger.snapshot(thread)).head_version is None


@pytest.mark.parametrize(
    "name",
    ["x" * 5000, "pipeline\n\x1b[31mRED", "<script>alert(1)</script>", "Pipeline"],
    ids=["long", "control", "markup", "not-lower-case"],
)
async def test_a_policy_name_that_is_not_one_is_not_repeated(
    target: str, pki: Pki, ledger: Ledger, name: str
) -> None:
    """CreateThread with a policy name no policy may have: POLICY_NOT_FOUND, the name
    not repeated in the answer (nor so in the rejection it may become), nothing created."""
    thread = new_thread_id()
    async with client(target, pki.operator()) as operator:
        error = await refused(
            ledger,
            thread,
            operator.create_thread(thread, INITIAL, policy=name),
            ZtateError,
            "POLICY_NOT_FOUND",
        )
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert str(error.message) == "no policy by that name is loaded: it is not a policy name"
    assert (await ledger.snapshot(thread)).head_version is None


async def test_unknown_transition(target: str, pki: Pki) -> None:
    async with client(target, pki.operator()) as operator:
        with pytest.raises(NotFound) as caught:
            await operator.get_transition(digest="0" * 64)
    assert caught.value.reason == "TRANSITION_NOT_FOUND"
