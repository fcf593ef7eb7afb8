"""The policy's evaluation at its edges, over real gRPC, mTLS and Postgres (a service
and a database of this module's own, with tests/policies/probe.yaml): what a refusal
tells a node about keys it may not read, a refusal with a thousand problems, an
expression that cannot be evaluated on a state, and what a version wakes."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.harness import Ledger, Pki, client, fresh_database
from ztate.contract.keyring import Keyring
from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start
from ztate.worker_sdk import AwaitingApproval, ZtateError

PROBE = Path(__file__).resolve().parents[1] / "policies" / "probe.yaml"
LIMIT = 16 * 1024


class Probe:
    def __init__(self, service: RunningService, ledger: Ledger, dsn: str) -> None:
        self.target = f"localhost:{service.port}"
        self.ledger, self.dsn = ledger, dsn


@pytest_asyncio.fixture(scope="module")
async def probe(
    postgres_server_dsn: str,
    settings: Settings,
    keyring_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Probe]:
    policies = tmp_path_factory.mktemp("probe-policies")
    shutil.copyfile(PROBE, policies / "probe.yaml")
    dsn = await fresh_database(postgres_server_dsn)
    update = {
        "policy_path": policies,
        "max_state_bytes": LIMIT,
        "max_patch_bytes": 64 * 1024,  # room for a patch with a thousand problems
        "listen": "127.0.0.1:0",
    }
    service = await start(settings.model_copy(update=update), dsn=dsn)
    yield Probe(service, Ledger(dsn, Keyring.load(keyring_file, None)), dsn)
    await service.stop(grace=1.0)


async def thread(probe: Probe, pki: Pki, state: dict[str, object]) -> str:
    thread_id = f"t-{uuid.uuid4().hex[:12]}"
    async with client(probe.target, pki.operator()) as operator:
        await operator.create_thread(thread_id, state, policy="probe")
    return thread_id


async def test_a_state_over_the_limit_says_nothing_of_keys_the_node_may_not_read(
    probe: Probe, pki: Pki
) -> None:
    """STATE_TOO_LARGE named the size of the whole state a change would make, hidden
    keys included: one proposal over the limit told a node the length of a value it may
    not read. The refusal now names the limit only, the same whatever the hidden value."""
    said = set()
    for secret in ("yes", "approve-refund-9912"):
        thread_id = await thread(probe, pki, {"secret_word": secret})
        async with client(probe.target, pki.node("prober")) as prober:
            await prober.propose(thread_id, 0, {"pad_a": "a" * 9000})
            before = await probe.ledger.snapshot(thread_id)
            with pytest.raises(ZtateError) as refused:
                await prober.propose(thread_id, 1, {"pad_b": "b" * 9000})
        assert (refused.value.code, refused.value.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "STATE_TOO_LARGE",
        )
        assert refused.value.limit == LIMIT
        assert await probe.ledger.snapshot(thread_id) == before  # nothing committed
        said.add(refused.value.message)
    assert said == {f"the resulting state would be larger than the limit of {LIMIT} bytes"}


async def test_a_refusal_with_a_thousand_problems_reaches_the_node_whole(
    probe: Probe, pki: Pki
) -> None:
    """An object with 1,500 undeclared members made a SCHEMA_VIOLATION message of 100 KB,
    over gRPC's 16 KiB for trailers: the node got a bare RESOURCE_EXHAUSTED, not the
    refusal. The message names the first 32 problems and counts the rest."""
    thread_id = await thread(probe, pki, {"pad_a": "x"})
    flood = {"id": "A-1", **{f"extra_member_{i:04d}": i for i in range(1500)}}
    async with client(probe.target, pki.node("prober")) as prober:
        before = await probe.ledger.snapshot(thread_id)
        with pytest.raises(ZtateError) as refused:
            await prober.propose(thread_id, 0, {"order": flood})
    assert (refused.value.code, refused.value.reason) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "SCHEMA_VIOLATION",
    )
    assert refused.value.keys == ("order",)
    assert refused.value.message.endswith("; and 1468 more")
    assert refused.value.message.count("extra_member_") == 32
    assert await probe.ledger.snapshot(thread_id) == before
    [row] = await probe.ledger.rejections(thread_id)
    assert row["reason"] == "SCHEMA_VIOLATION"


async def test_an_invariant_that_cannot_be_evaluated_refuses_with_a_row(
    probe: Probe, pki: Pki
) -> None:
    """An index out of range (the CEL library's IndexError) was an INTERNAL with no
    rejection row; an invariant that cannot be evaluated does not hold."""
    thread_id = await thread(probe, pki, {"pad_a": "x"})
    async with client(probe.target, pki.node("prober")) as prober:
        before = await probe.ledger.snapshot(thread_id)
        with pytest.raises(ZtateError) as refused:
            await prober.propose(thread_id, 0, {"items": []})
    assert refused.value.reason == "INVARIANT_VIOLATED"
    assert refused.value.rules == ("first-item-not-root",)
    assert await probe.ledger.snapshot(thread_id) == before
    [row] = await probe.ledger.rejections(thread_id)
    assert row["reason"] == "INVARIANT_VIOLATED"


async def test_a_risk_rule_that_cannot_be_evaluated_parks_the_change(
    probe: Probe, pki: Pki
) -> None:
    """int() of a text that is no number (the CEL library's RuntimeError) was an
    INTERNAL; a risk rule that cannot be evaluated matches (fail closed): parked."""
    thread_id = await thread(probe, pki, {"pad_a": "x"})
    async with client(probe.target, pki.node("prober")) as prober:
        with pytest.raises(AwaitingApproval):
            await prober.propose(thread_id, 0, {"count_text": "twelve"})
        assert (await prober.propose(thread_id, 0, {"count_text": "3"})).version == 1


async def test_a_timestamp_offset_beyond_rfc_3339_is_refused(probe: Probe, pki: Pki) -> None:
    """An offset of +00:99 passed the timestamp type (Python reads minutes up to 99),
    and CEL's timestamp() could not read it."""
    thread_id = await thread(probe, pki, {"pad_a": "x"})
    async with client(probe.target, pki.node("prober")) as prober:
        before = await probe.ledger.snapshot(thread_id)
        for stamp in ("2026-01-02T03:04:05+00:99", "2026-01-02T03:04:05+24:00"):
            with pytest.raises(ZtateError) as refused:
                await prober.propose(thread_id, 0, {"stamp": stamp})
            assert refused.value.reason == "SCHEMA_VIOLATION"
        assert await probe.ledger.snapshot(thread_id) == before
        assert (await prober.propose(thread_id, 0, {"stamp": "2026-01-02T03:04:05+23:59"})).version


async def test_the_same_value_again_wakes_no_one(probe: Probe, pki: Pki) -> None:
    """A version wakes the nodes whose keys it really changed: the same order written
    again commits (a patch may repeat a value) but does not hand the follower the
    thread again, as the first write did."""
    thread_id = await thread(probe, pki, {"pad_a": "x"})
    conn = await asyncpg.connect(probe.dsn)
    try:

        async def wake_version() -> int | None:
            version: int | None = await conn.fetchval(
                "SELECT wake_version FROM ztate.node_work WHERE thread_id = $1 AND node = $2",
                thread_id,
                "follower",
            )
            return version

        async with client(probe.target, pki.node("prober")) as prober:
            await prober.propose(thread_id, 0, {"order": {"id": "A-1"}})
            assert await wake_version() == 1
            await prober.propose(thread_id, 1, {"order": {"id": "A-1"}, "pad_a": "y"})
            assert await wake_version() == 1  # the order did not change
            await prober.propose(thread_id, 2, {"order": {"id": "A-2"}})
            assert await wake_version() == 3
    finally:
        await conn.close()
