"""The central path: create, view, propose, commit, chain, over mTLS on real Postgres."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from tests.harness import INITIAL, USER, Ledger, Pki, act, client, new_thread_id
from ztate.contract.canonical import canonical_bytes
from ztate.contract.record import GENESIS_PARENT, verify_record
from ztate.transition_service.app import RunningService
from ztate.worker_sdk import StaleVersion, ZtateClient


async def create(target: str, pki: Pki, state: dict[str, object] | None = None) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(
            thread_id, INITIAL if state is None else state, policy="pipeline"
        )
    return thread_id


async def test_proposal_commits_view_moves_and_record_verifies(
    target: str, pki: Pki, ledger: Ledger, service: RunningService
) -> None:
    thread_id = await create(target, pki)
    async with client(target, pki.node("input-parser")) as parser:
        view = await parser.get_view(thread_id)
        assert view.version == 0
        assert view.state == {"raw_text": INITIAL["raw_text"]}  # only its readable keys
        committed = await parser.propose(thread_id, 0, {"requested_action": act("refund")})

    assert committed.version == 1
    assert committed.parent_digest == view.head_digest
    assert committed.node_id == "spiffe://ztate.test/node/input-parser"
    async with client(target, pki.node("planner")) as planner:
        seen = await planner.get_view(thread_id)
    assert seen.version == 1
    assert seen.head_digest == committed.digest
    assert seen.state == {
        "requested_action": act("refund"),
        "authority": INITIAL["authority"],
        "target_user_id": USER,
    }

    rows = await ledger.rows(thread_id)
    assert [r["version"] for r in rows] == [0, 1]
    row = rows[1]
    record = verify_record(
        bytes(row["record"]),
        digest=row["digest"],
        signature=row["signature"],
        keyring=ledger.keyring,
        expected_parent=rows[0]["digest"],
        expected_version=1,
    )
    assert hashlib.sha256(bytes(row["record"])).hexdigest() == row["digest"]
    # the input parser is told the version, no record nor digest (docs/api.md)
    assert (committed.version, committed.digest, committed.record_json) == (1, "", b"")
    state_after = {**INITIAL, "requested_action": act("refund")}
    assert record == {
        "format": 2,  # with the risk rules it matched: none
        "kind": "transition",
        "thread_id": thread_id,
        "version": 1,
        "parent_digest": rows[0]["digest"],
        "node_id": "spiffe://ztate.test/node/input-parser",
        "patch": {"requested_action": act("refund")},
        "state_digest": hashlib.sha256(canonical_bytes(state_after)).hexdigest(),
        "policy_digest": record["policy_digest"],
        "receipt_digest": None,
        "key_id": "test-k1",
        "committed_at": record["committed_at"],
        "risk_rules": [],
    }
    assert bytes(row["state"]) == canonical_bytes(state_after)
    assert rows[0]["parent_digest"] == GENESIS_PARENT
    assert await ledger.verify(thread_id) == 2


async def test_null_member_removes_a_key(target: str, pki: Pki, ledger: Ledger) -> None:
    thread_id = await create(target, pki)
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("refund")})
        await parser.propose(thread_id, 1, {"requested_action": None})
    async with client(target, pki.operator()) as operator:
        view = await operator.get_view(thread_id)
    assert view.version == 2
    assert view.state == INITIAL
    assert await ledger.verify(thread_id) == 3


async def test_concurrent_proposers_one_commit_per_version(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """32 writers race from the same base each round: one wins, 31 are told they are stale."""
    thread_id = await create(target, pki)
    writers = [client(target, pki.node("input-parser")) for _ in range(32)]
    rounds = 3
    try:
        for base in range(rounds):
            outcomes = await asyncio.gather(
                *(
                    w.propose(
                        thread_id, base, {"requested_action": act(f"writer-{i}-round-{base}")}
                    )
                    for i, w in enumerate(writers)
                ),
                return_exceptions=True,
            )
            winners = [o for o in outcomes if not isinstance(o, BaseException)]
            losers = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(winners) == 1, outcomes
            assert winners[0].version == base + 1
            assert len(losers) == 31
            assert all(isinstance(o, StaleVersion) for o in losers), losers
            assert {o.current_version for o in losers if isinstance(o, StaleVersion)} == {base + 1}
    finally:
        await asyncio.gather(*(w.close() for w in writers))

    rows = await ledger.rows(thread_id)
    assert [r["version"] for r in rows] == list(range(rounds + 1))  # no gap
    assert len({r["parent_digest"] for r in rows}) == len(rows)  # no fork
    assert await ledger.verify(thread_id) == rounds + 1
    stale = [r for r in await ledger.rejections(thread_id) if r["reason"] == "STALE_VERSION"]
    assert len(stale) == 31 * rounds


async def test_retry_with_same_idempotency_key_returns_original(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = await create(target, pki)
    async with client(target, pki.node("input-parser")) as parser:
        first = await parser.propose(
            thread_id, 0, {"requested_action": act("refund")}, idempotency_key="req-1"
        )
        retry = await parser.propose(
            thread_id, 0, {"requested_action": act("refund")}, idempotency_key="req-1"
        )
    assert not first.replayed
    assert retry.replayed
    assert (retry.digest, retry.version, retry.signature) == (
        first.digest,
        first.version,
        first.signature,
    )
    snapshot = await ledger.snapshot(thread_id)
    assert (snapshot.head_version, snapshot.transitions) == (1, 2)
    assert await ledger.rejections(thread_id) == []


async def test_replay_still_answers_after_the_head_moved_on(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = await create(target, pki)
    async with client(target, pki.node("input-parser")) as parser:
        first = await parser.propose(
            thread_id, 0, {"requested_action": act("a")}, idempotency_key="k-a"
        )
        await parser.propose(thread_id, 1, {"requested_action": act("b")}, idempotency_key="k-b")
        retry = await parser.propose(
            thread_id, 0, {"requested_action": act("a")}, idempotency_key="k-a"
        )
    assert retry.replayed
    assert (retry.version, retry.committed_at) == (first.version, first.committed_at)
    assert (await ledger.snapshot(thread_id)).transitions == 3


async def test_transition_lookup_by_digest_and_by_version(target: str, pki: Pki) -> None:
    thread_id = await create(target, pki)
    async with client(target, pki.node("input-parser")) as parser:
        committed = await parser.propose(thread_id, 0, {"requested_action": act("refund")})
    async with client(target, pki.operator()) as operator:
        by_version = await operator.get_transition(thread_id=thread_id, version=1)
        by_digest = await operator.get_transition(digest=by_version.digest)
    assert by_digest.record_json == by_version.record_json
    assert by_digest.signature == by_version.signature
    assert committed.version == by_version.version == 1
    assert json.loads(by_digest.record_json)["patch"] == {"requested_action": act("refund")}


async def test_reads_are_projected_for_every_node(target: str, pki: Pki) -> None:
    full = {
        **INITIAL,
        "requested_action": act("y"),
        "execution_permissions": ["read_orders"],
        "result_ref": "db://refunds/1",
    }
    thread_id = await create(target, pki, full)
    expected = {
        "input-parser": {"raw_text"},
        "planner": {"requested_action", "authority", "target_user_id"},
        "approval-gate": {"authority", "target_user_id", "execution_permissions"},
        "db-writer": {"target_user_id", "execution_permissions"},
    }
    for node, keys in expected.items():
        async with client(target, pki.node(node)) as worker:
            view = await worker.get_view(thread_id)
        assert set(view.state) == keys, node


@pytest.mark.parametrize("role", ["operator"])
async def test_operator_sees_the_whole_state(target: str, pki: Pki, role: str) -> None:
    thread_id = await create(target, pki)
    async with client(target, pki.operator()) as operator:
        view = await operator.get_view(thread_id)
    assert view.state == INITIAL


async def test_sdk_client_is_reusable_across_threads(target: str, pki: Pki) -> None:
    threads = [await create(target, pki) for _ in range(3)]
    worker: ZtateClient = client(target, pki.node("input-parser"))
    async with worker:
        results = [await worker.propose(t, 0, {"requested_action": act(t)}) for t in threads]
    assert [r.thread_id for r in results] == threads


async def test_null_members_of_an_initial_state_are_not_state(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """The genesis patch is applied like any other: a null member sets nothing."""
    thread_id = await create(target, pki, {"raw_text": "x", "result_ref": None})
    async with client(target, pki.operator()) as operator:
        view = await operator.get_view(thread_id)
        genesis = await operator.get_transition(thread_id=thread_id, version=0)
    assert view.state == {"raw_text": "x"}
    assert genesis.record["patch"] == {"raw_text": "x", "result_ref": None}
    assert genesis.record["state_digest"] == hashlib.sha256(b'{"raw_text":"x"}').hexdigest()
    assert await ledger.verify(thread_id) == 1
