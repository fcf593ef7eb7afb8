"""Every answer bounded by design, none cut by accident (issue 11, item 3).

Replies were capped at the patch limit + 64 KiB: a state grown past it by accepted
patches could no longer be read, ledger pages failed inside their documented sizes, one
proposal naming ~950 unknown keys blinded the operator's rejection listing, and a
refusal naming ~60 keys overflowed gRPC's 16 KiB trailer limit. Now the state has a
documented limit enforced when a change is applied (STATE_TOO_LARGE), replies are
bounded by a limit derived from it, pages fill up to a byte budget, and refusals name
at most 32 keys and count the rest.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from tests.harness import (
    TRUST_DOMAIN,
    Ledger,
    Pki,
    client,
    fresh_database,
    secure_channel,
)
from ztate.contract.keyring import Keyring
from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start
from ztate.v1 import errors_pb2, ledger_pb2, ledger_pb2_grpc, transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import PermissionDenied, StateTooLarge

REPO = Path(__file__).resolve().parents[2]
MAX_PATCH = 24 * 1024
MAX_STATE = 128 * 1024
OLD_REPLY_CAP = MAX_PATCH + 64 * 1024  # what every reply was capped at before
PAGE = "lorem ipsum dolor sit amet " * 660  # ~17.8 KB of low-entropy text
PAGES = [f"page_{c}" for c in "abcdefgh"]


@pytest_asyncio.fixture(scope="module")
async def scribed(
    postgres_server_dsn: str,
    pki: Pki,
    keyring_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[RunningService, Ledger]]:
    root = tmp_path_factory.mktemp("bounds")
    policies = root / "policies"
    policies.mkdir()
    shutil.copyfile(REPO / "tests" / "policies" / "scribe.yaml", policies / "scribe.yaml")
    dsn = await fresh_database(postgres_server_dsn)
    settings = Settings(
        home=root / "home",
        listen="127.0.0.1:0",
        trust_domain=TRUST_DOMAIN,
        tls_cert=pki.certs / "service-transition.crt",
        tls_key=pki.certs / "service-transition.key",
        tls_ca=pki.certs / "ca.crt",
        policy_path=policies,
        hmac_keyring_file=keyring_file,
        max_patch_bytes=MAX_PATCH,
        max_state_bytes=MAX_STATE,
        db_pool_size=4,
    )
    service = await start(settings, dsn=dsn)
    yield service, Ledger(dsn, Keyring.load(keyring_file, None))
    await service.stop(grace=1.0)


async def grown_thread(target: str, pki: Pki) -> str:
    """A thread whose state grew, by accepted patches, past the old reply cap."""
    thread_id = f"big-{uuid.uuid4().hex[:10]}"
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, {"title": "notes"})
    async with client(target, pki.node("scribe")) as scribe:
        for version, key in enumerate(PAGES[:7]):
            await scribe.propose(thread_id, version, {key: PAGE})
    return thread_id


async def test_a_reverts_detail_fits_the_reply_limit(
    scribed: tuple[RunningService, Ledger], pki: Pki, tmp_path: Path
) -> None:
    """A revert's patch is the whole state it restores, not bounded by the patch limit:
    its detail (the record holding it, the patch again, the state) went over the reply
    limit of state + 2 x patch + 64 KiB, and ``ztate ledger show`` of any revert of a
    state above about a third of the limit failed with RESOURCE_EXHAUSTED."""
    service, _ledger = scribed
    target = f"localhost:{service.port}"
    thread_id = await grown_thread(target, pki)  # version 7, a state of ~125 KB
    async with client(target, pki.node("scribe")) as scribe:
        await scribe.propose(thread_id, 7, {"page_a": "short"})  # version 8
    async with secure_channel(target, pki.operator()) as opened:
        await transition_pb2_grpc.TransitionServiceStub(opened).RevertThread(
            transition_pb2.RevertThreadRequest(
                thread_id=thread_id, to_version=7, idempotency_key="revert-1"
            )
        )  # version 9: its patch is the whole state of version 7
        detail = await ledger_pb2_grpc.LedgerServiceStub(opened).GetTransitionDetail(
            ledger_pb2.GetTransitionDetailRequest(thread_id=thread_id, version=9)
        )
    assert len(detail.state_json) > 3 * OLD_REPLY_CAP // 4
    assert detail.ByteSize() > MAX_STATE + 2 * MAX_PATCH + 64 * 1024  # the old limit


async def test_a_state_past_the_old_cap_stays_readable_everywhere(
    scribed: tuple[RunningService, Ledger], pki: Pki, tmp_path: Path
) -> None:
    service, _ledger = scribed
    target = f"localhost:{service.port}"
    thread_id = await grown_thread(target, pki)
    async with client(target, pki.node("scribe")) as scribe:
        view = await scribe.get_view(thread_id)
        assert len(json.dumps(view.state)) > OLD_REPLY_CAP
        watched = []
        async for event in scribe.watch(thread_id, from_version=-1):
            watched.append(event.version)
            if event.version == 7:
                break
    assert watched == list(range(8))
    async with secure_channel(target, pki.operator()) as opened:
        detail = await ledger_pb2_grpc.LedgerServiceStub(opened).GetTransitionDetail(
            ledger_pb2.GetTransitionDetailRequest(thread_id=thread_id, version=7)
        )
    assert len(detail.state_json) > OLD_REPLY_CAP
    creds = pki.operator()
    shown = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        *("ledger", "show", "--thread", thread_id, "--version", "7", "--json"),
        *("--target", target, "--cert", str(creds.cert), "--key", str(creds.key)),
        *("--ca", str(creds.ca)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(shown.communicate(), 60)
    assert shown.returncode == 0, err.decode()
    assert len(out) > OLD_REPLY_CAP


async def test_a_patch_that_would_outgrow_the_state_limit_is_refused(
    scribed: tuple[RunningService, Ledger], pki: Pki
) -> None:
    service, ledger = scribed
    target = f"localhost:{service.port}"
    thread_id = await grown_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    async with client(target, pki.node("scribe")) as scribe:
        with pytest.raises(StateTooLarge) as refused:
            await scribe.propose(thread_id, 7, {"page_h": PAGE})
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (refused.value.reason, refused.value.limit) == ("STATE_TOO_LARGE", MAX_STATE)
    assert await ledger.snapshot(thread_id) == before
    [row] = await ledger.rejections(thread_id)
    assert row["reason"] == "STATE_TOO_LARGE"


async def test_pages_fill_up_to_a_byte_budget_and_never_fail(
    scribed: tuple[RunningService, Ledger], pki: Pki
) -> None:
    """KeyHistory of a key rewritten with ~18 KB values, at the documented page size:
    short pages with tokens that, together, give every change exactly once."""
    service, _ledger = scribed
    target = f"localhost:{service.port}"
    thread_id = f"hist-{uuid.uuid4().hex[:10]}"
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, {"title": "notes"})
    async with client(target, pki.node("scribe")) as scribe:
        for version in range(26):  # 26 x 18 KB: over the whole reply limit (3 x 128 KiB)
            await scribe.propose(thread_id, version, {"page_a": f"{version:02d} {PAGE}"})
    seen: list[int] = []
    pages = 0
    token = ""
    async with secure_channel(target, pki.operator()) as opened:
        stub = ledger_pb2_grpc.LedgerServiceStub(opened)
        while True:
            response = await stub.KeyHistory(
                ledger_pb2.KeyHistoryRequest(
                    thread_id=thread_id, key="page_a", page_size=1000, page_token=token
                )
            )
            pages += 1
            assert response.ByteSize() < 3 * MAX_STATE  # the budget, from the limit
            seen += [change.version for change in response.changes]
            token = response.next_page_token
            if not token:
                break
    assert pages > 1
    assert seen == list(range(1, 27))


async def test_a_flood_of_unknown_keys_leaves_a_small_row_and_readable_trailers(
    scribed: tuple[RunningService, Ledger], pki: Pki
) -> None:
    """One ~24 KB proposal naming 1,500 keys: before, its 125 KB row blinded ``ztate
    ledger rejections``, and the key list, sent three times in the trailers, was over a
    default client's 16 KiB metadata limit."""
    service, ledger = scribed
    target = f"localhost:{service.port}"
    thread_id = f"flood-{uuid.uuid4().hex[:10]}"
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, {"title": "notes"})
    flood = {f"k{i:04d}": 1 for i in range(1500)}
    patch = json.dumps(flood).encode()
    assert len(patch) < MAX_PATCH
    # a plain grpc channel: default options, default metadata limit
    async with secure_channel(target, pki.node("scribe")) as opened:
        call = opened.unary_unary(
            "/ztate.v1.TransitionService/ProposeTransition",
            request_serializer=transition_pb2.ProposeTransitionRequest.SerializeToString,
            response_deserializer=transition_pb2.ProposeTransitionResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(
                transition_pb2.ProposeTransitionRequest(
                    thread_id=thread_id, expected_version=0, patch_json=patch, idempotency_key="f"
                )
            )
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    detail = errors_pb2.ErrorDetail()
    for key, value in refused.value.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            from google.rpc import status_pb2

            for packed in status_pb2.Status.FromString(value).details:
                if packed.Is(errors_pb2.ErrorDetail.DESCRIPTOR):
                    packed.Unpack(detail)
    assert errors_pb2.ErrorReason.Name(detail.reason) == "ERROR_REASON_KEY_NOT_WRITABLE"
    assert (len(detail.keys), detail.keys_total) == (32, 1500)
    assert "and 1468 more" in (refused.value.details() or "")
    # the SDK names the same refusal, with the count
    async with client(target, pki.node("scribe")) as scribe:
        with pytest.raises(PermissionDenied) as typed:
            await scribe.propose(thread_id, 0, patch)
    assert (len(typed.value.keys), typed.value.keys_total) == (32, 1500)
    rows = await ledger.rejections(thread_id)
    assert [len(r["keys"]) for r in rows] == [32, 32]
    assert all(len(r["message"]) <= 1024 for r in rows)
    async with secure_channel(target, pki.operator()) as opened:
        listed = await ledger_pb2_grpc.LedgerServiceStub(opened).ListRejections(
            ledger_pb2.ListRejectionsRequest(thread_id=thread_id, page_size=1000)
        )
    assert len(listed.rejections) == 2
