"""Machinery for the policy-enforcement tests: actors, observations and refusals.

A refusal must leave everything as it was: the thread's head and ledger, the
proposing node's view and the full state an operator sees. It must also leave
exactly one row in the rejections ledger, naming the authenticated caller (never
a name the request claims), the reason, the keys at fault and a digest of the
refused bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import pytest

from tests.harness import (
    TRUST_DOMAIN,
    Ledger,
    LedgerSnapshot,
    Pki,
    as_operator_sees_it,
    client,
    new_thread_id,
)
from ztate.services.runtime.identity import Role
from ztate.worker_sdk import AwaitingApproval, ZtateClient, ZtateError, encode_json


@dataclass(frozen=True)
class Actor:
    """A connected caller and the SPIFFE ID its certificate carries."""

    role: Role
    name: str
    client: ZtateClient

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.name}"


@asynccontextmanager
async def connected(target: str, pki: Pki, role: Role, name: str) -> AsyncIterator[Actor]:
    async with client(target, pki.identity(role, name)) as worker:
        yield Actor(role, name, worker)


async def create_thread(
    operator: Actor, state: Mapping[str, Any], *, policy: str, thread_id: str | None = None
) -> str:
    thread = thread_id or new_thread_id()
    await operator.client.create_thread(thread, dict(state), policy=policy)
    return thread


async def view_or_reason(actor: Actor, thread_id: str) -> tuple[int, str, dict[str, Any]] | str:
    """The actor's view of the thread, or the reason it may not have one."""
    try:
        view = await actor.client.get_view(thread_id)
    except ZtateError as refusal:
        return refusal.reason
    return view.version, view.head_digest, view.state


@dataclass(frozen=True)
class Observation:
    snapshot: LedgerSnapshot
    view: tuple[int, str, dict[str, Any]] | str
    state: dict[str, Any]
    rejections: list[asyncpg.Record]

    def assert_unchanged_since(self, before: Observation) -> None:
        assert self.snapshot == before.snapshot
        assert self.view == before.view
        assert self.state == before.state


async def observe(ledger: Ledger, operator: Actor, actor: Actor, thread_id: str) -> Observation:
    return Observation(
        snapshot=await ledger.snapshot(thread_id),
        view=await view_or_reason(actor, thread_id),
        state=(await operator.client.get_view(thread_id)).state,
        rejections=await ledger.rejections(thread_id),
    )


@dataclass(frozen=True)
class Expect:
    """A precise refusal: the SDK class, the reason, the gRPC code and the details."""

    error: type[ZtateError]
    reason: str
    code: grpc.StatusCode
    keys: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()
    # the reason the rejections ledger records, when the caller is told another
    recorded: str | None = None


def wire(patch: Mapping[str, Any] | bytes) -> bytes:
    return patch if isinstance(patch, bytes) else encode_json(dict(patch))


async def refused(
    ledger: Ledger,
    operator: Actor,
    actor: Actor,
    thread_id: str,
    patch: Mapping[str, Any] | bytes,
    expect: Expect,
    *,
    version: int = 0,
    idempotency_key: str | None = None,
) -> tuple[ZtateError, asyncpg.Record]:
    """Propose ``patch`` as ``actor``; assert the precise refusal, that nothing
    changed, and that exactly one rejection row records it. Returns both."""
    data = wire(patch)
    before = await observe(ledger, operator, actor, thread_id)
    with pytest.raises(ZtateError) as caught:
        await actor.client.propose(thread_id, version, data, idempotency_key=idempotency_key)
    error = caught.value
    assert type(error) is expect.error, error
    assert (error.reason, error.code) == (expect.reason, expect.code), error
    assert error.keys == expect.keys, error
    assert error.rules == expect.rules, error
    after = await observe(ledger, operator, actor, thread_id)
    after.assert_unchanged_since(before)
    new_rows = after.rejections[len(before.rejections) :]
    assert len(new_rows) == 1, new_rows
    [row] = new_rows
    assert row["method"] == "ProposeTransition"
    assert row["reason"] == (expect.recorded or expect.reason)
    assert row["node_id"] == actor.spiffe_id
    assert row["thread_id"] == thread_id
    assert row["base_version"] == version
    assert tuple(row["keys"]) == expect.keys
    assert row["patch_digest"] == hashlib.sha256(data).hexdigest()
    assert row["patch_bytes"] == len(data)
    return error, row


async def pending_rows(dsn: str, thread_id: str) -> list[asyncpg.Record]:
    """The thread's parked proposals, oldest first."""
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(
            "SELECT * FROM ztate.pending_transitions WHERE thread_id = $1 ORDER BY parked_at",
            thread_id,
        )
    finally:
        await conn.close()


def proposal_of(row: asyncpg.Record) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(bytes(row["proposal"]))
    return parsed


def assert_digest(value: str) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", value), value


@dataclass
class Env:
    """Connected actors and direct ledger access, with the assertions every test shares."""

    ledger: Ledger
    actors: dict[str, Actor]

    def __getitem__(self, name: str) -> Actor:
        return self.actors[name]

    @property
    def operator(self) -> Actor:
        return self.actors["operator"]

    async def thread(
        self,
        state: Mapping[str, Any],
        *,
        policy: str = "pipeline",
        thread_id: str | None = None,
    ) -> str:
        return await create_thread(self.operator, state, policy=policy, thread_id=thread_id)

    async def state(self, thread_id: str) -> dict[str, Any]:
        return (await self.operator.client.get_view(thread_id)).state

    async def refused(
        self,
        who: str,
        thread_id: str,
        patch: Mapping[str, Any] | bytes,
        expect: Expect,
        *,
        version: int = 0,
        idempotency_key: str | None = None,
    ) -> tuple[ZtateError, asyncpg.Record]:
        return await refused(
            self.ledger,
            self.operator,
            self[who],
            thread_id,
            patch,
            expect,
            version=version,
            idempotency_key=idempotency_key,
        )

    async def parked(
        self,
        who: str,
        thread_id: str,
        patch: Mapping[str, Any],
        rules: tuple[str, ...],
        *,
        version: int = 0,
        idempotency_key: str | None = None,
    ) -> tuple[AwaitingApproval, asyncpg.Record]:
        """Propose a risky ``patch``: assert it was parked for ``rules``, not
        committed, refused nor recorded as a rejection, and that its pending row
        holds the exact proposal its digest covers."""
        actor = self[who]
        before = await observe(self.ledger, self.operator, actor, thread_id)
        with pytest.raises(AwaitingApproval) as caught:
            await actor.client.propose(
                thread_id, version, wire(patch), idempotency_key=idempotency_key
            )
        told = caught.value
        # the proposer learns that it was parked and how to wait, nothing that
        # commits to state it may not read (unless its policy marks it read_records)
        if not told.digest:
            assert told.risk_rules == ()
            assert told.handle.startswith(f"{thread_id}/")
        waiting = await as_operator_sees_it(self.ledger.dsn, told)
        assert_digest(waiting.digest)
        assert waiting.risk_rules == rules
        assert (waiting.thread_id, waiting.base_version) == (thread_id, version)
        after = await observe(self.ledger, self.operator, actor, thread_id)
        after.assert_unchanged_since(before)
        assert after.rejections == before.rejections
        [row] = [
            r
            for r in await pending_rows(self.ledger.dsn, thread_id)
            if r["digest"] == waiting.digest
        ]
        assert row["status"] == "pending"
        assert hashlib.sha256(bytes(row["proposal"])).hexdigest() == waiting.digest
        proposal = proposal_of(row)
        assert proposal["kind"] == "proposal"
        assert proposal["thread_id"] == thread_id
        assert proposal["node_id"] == row["node_id"] == actor.spiffe_id
        assert proposal["base_version"] == row["base_version"] == version
        assert proposal["parent_digest"] == row["parent_digest"] == before.snapshot.head_digest
        assert proposal["patch"] == dict(patch)
        assert proposal["risk_rules"] == list(row["risk_rules"]) == list(rules)
        if idempotency_key is not None:
            assert row["idempotency_key"] == idempotency_key
        return waiting, row
