"""Key rotation, retention (pruning state bodies) and repair (reverting a thread),
against a real Postgres and a real mTLS transition service.

Everything runs in a database of its own, with a keyring file of its own, so that
rotating keys and pruning every thread never touch another test's data. After
each operation the chain must still verify and nothing but what the operation
promises may have changed.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2, status_pb2

from tests.citus.lanes import LANES, lane_database
from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    Credentials,
    Ledger,
    Pki,
    act,
    client,
    new_thread_id,
)
from ztate.contract.errors import RecordInvalid
from ztate.contract.keyring import Keyring, rotate_keyring_file
from ztate.services.policy.model import PolicySet
from ztate.services.runtime.config import Settings
from ztate.services.store.retention import Limits, RetentionError, prune
from ztate.services.verify.checks import Trust, verify_database
from ztate.transition_service.app import RunningService, start
from ztate.v1 import transition_pb2, transition_pb2_grpc

OPERATOR = f"spiffe://{TRUST_DOMAIN}/operator/admin"
ZTATE = os.path.join(os.path.dirname(sys.executable), "ztate")


@dataclass
class World:
    """A transition service on a database and keyring of its own."""

    dsn: str
    pki: Pki
    settings: Settings
    keyring_file: Path
    service: RunningService
    policies: PolicySet

    @property
    def target(self) -> str:
        return f"localhost:{self.service.port}"

    @property
    def keyring(self) -> Keyring:
        return Keyring.load(self.keyring_file, None)

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.dsn, self.keyring)

    async def restart(self) -> None:
        await self.service.stop(grace=1.0)
        self.service = await start(self.settings, dsn=self.dsn)

    async def thread(self, versions: int) -> str:
        """A thread with ``versions`` records: genesis, then requested actions."""
        thread_id = new_thread_id()
        async with client(self.target, self.pki.operator()) as operator:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        async with client(self.target, self.pki.node("input-parser")) as parser:
            for version in range(versions - 1):
                await parser.propose(thread_id, version, {"requested_action": act(f"a{version}")})
        return thread_id

    async def revert(
        self, thread_id: str, to_version: int, key: str, creds: Credentials | None = None
    ) -> transition_pb2.RevertThreadResponse:
        creds = creds or self.pki.operator()
        credentials = grpc.ssl_channel_credentials(
            creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
        )
        async with grpc.aio.secure_channel(self.target, credentials) as channel:
            stub = transition_pb2_grpc.TransitionServiceStub(channel)
            response: transition_pb2.RevertThreadResponse = await stub.RevertThread(
                transition_pb2.RevertThreadRequest(
                    thread_id=thread_id, to_version=to_version, idempotency_key=key
                ),
                timeout=10,
            )
            return response

    async def verify_all(self, thread_id: str | None = None) -> tuple[list[Any], int, int]:
        findings: list[Any] = []
        summary = await verify_database(
            self.dsn, Trust(self.keyring, {}, self.policies), findings.append, thread_id=thread_id
        )
        return findings, summary.records, summary.failures

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()


@pytest_asyncio.fixture(scope="module", params=LANES)
async def world(
    request: pytest.FixtureRequest,
    pki: Pki,
    keyring_file: Path,
    settings: Settings,
    policy_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[World]:
    """A service with a keyring of its own, on a fresh database of each lane (Postgres;
    Citus in its lane)."""
    root = tmp_path_factory.mktemp("retention")
    dsn = await lane_database(request.param, request)
    own_keyring = root / "hmac-keyring.json"
    shutil.copyfile(keyring_file, own_keyring)
    own = settings.model_copy(
        update={"home": root / "home", "hmac_keyring_file": own_keyring, "db_pool_size": 4}
    )
    service = await start(own, dsn=dsn)
    opened = World(dsn, pki, own, own_keyring, service, PolicySet.load(policy_dir))
    yield opened
    await opened.service.stop(grace=1.0)


def refusal(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and the ErrorInfo reason of a refused call."""
    metadata: Any = error.trailing_metadata() or ()
    [details] = [value for key, value in metadata if key == "grpc-status-details-bin"]
    assert isinstance(details, bytes)
    info = error_details_pb2.ErrorInfo()
    assert status_pb2.Status.FromString(details).details[0].Unpack(info)
    return error.code(), info.reason


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        ZTATE,
        *args,
        stdin=asyncio.subprocess.DEVNULL,  # not a terminal: nobody to confirm a prune
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def prune_on_a_terminal(env: dict[str, str], answer: bytes) -> tuple[int, str, str]:
    """``ztate ledger prune --keep-versions 1`` with a terminal on stdin that answers."""
    controller, terminal = pty.openpty()
    try:
        process = await asyncio.create_subprocess_exec(
            ZTATE, "ledger", "prune", "--keep-versions", "1",
            stdin=terminal, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **env},
        )  # fmt: skip
        os.write(controller, answer)  # read once the question is asked (the line waits)
        stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    finally:
        os.close(terminal)
        os.close(controller)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


# --- keys -------------------------------------------------------------------------------


async def test_a_rotated_keyring_signs_new_records_and_verifies_old_ones(world: World) -> None:
    thread_id = await world.thread(2)
    old = world.keyring
    new_id = rotate_keyring_file(world.keyring_file)
    await world.restart()
    async with client(world.target, world.pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 1, {"requested_action": act("after-rotation")})

    rows = await world.ledger.rows(thread_id)
    assert [r["key_id"] for r in rows] == [old.current, old.current, new_id]
    assert [json.loads(r["record"])["key_id"] for r in rows] == [r["key_id"] for r in rows]
    assert await world.ledger.verify(thread_id) == 3
    assert await world.verify_all(thread_id) == ([], 3, 0)
    with pytest.raises(RecordInvalid) as unknown:
        await Ledger(world.dsn, old).verify(thread_id)
    assert (unknown.value.check, str(unknown.value)) == (
        "record.key_id",
        f"unknown key id {new_id!r}",
    )


# --- revert -----------------------------------------------------------------------------


async def states(world: World, thread_id: str) -> list[dict[str, Any] | None]:
    rows = await world.ledger.rows(thread_id)
    return [None if r["state"] is None else json.loads(r["state"]) for r in rows]


async def test_revert_appends_a_transition_restoring_an_earlier_state(world: World) -> None:
    thread_id = await world.thread(3)
    before = await world.ledger.rows(thread_id)
    kept = await states(world, thread_id)

    done = await world.revert(thread_id, 0, "undo-1")

    rows = await world.ledger.rows(thread_id)
    assert rows[:3] == before  # history is never rewritten
    assert (done.transition.version, done.replayed) == (3, False)
    assert done.transition.node_id == OPERATOR
    record = json.loads(rows[3]["record"])
    assert record["kind"] == "revert"
    assert record["node_id"] == OPERATOR
    assert record["parent_digest"] == before[2]["digest"]
    assert record["patch"] == {**INITIAL, "requested_action": None}
    assert json.loads(rows[3]["state"]) == kept[0]
    assert (rows[3]["digest"], rows[3]["idempotency_key"]) == (done.transition.digest, "undo-1")
    head = await world.fetch(
        "SELECT version, head_digest, state FROM ztate.threads WHERE thread_id = $1", thread_id
    )
    assert (head[0]["version"], head[0]["head_digest"]) == (3, done.transition.digest)
    assert json.loads(head[0]["state"]) == kept[0]
    assert await world.ledger.verify(thread_id) == 4

    # the thread goes on from the reverted head
    async with client(world.target, world.pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 3, {"requested_action": act("again")})
    assert await world.ledger.verify(thread_id) == 5
    # the offline verifier accepts the revert record too
    assert await world.verify_all(thread_id) == ([], 5, 0)


async def test_revert_to_a_middle_version_and_its_replay(world: World) -> None:
    thread_id = await world.thread(3)
    kept = await states(world, thread_id)
    first = await world.revert(thread_id, 1, "undo-mid")
    again = await world.revert(thread_id, 1, "undo-mid")
    assert again.replayed
    assert again.transition == first.transition
    assert (await world.ledger.snapshot(thread_id)).transitions == 4
    assert (await states(world, thread_id))[3] == kept[1]

    with pytest.raises(grpc.aio.AioRpcError) as reused:
        await world.revert(thread_id, 0, "undo-mid")
    assert refusal(reused.value) == (grpc.StatusCode.INVALID_ARGUMENT, "IDEMPOTENCY_KEY_REUSED")
    assert (await world.ledger.snapshot(thread_id)).transitions == 4


@pytest.mark.parametrize(
    ("to_version", "code", "reason", "message"),
    [
        (-1, grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_INVALID", "0 to 1; found -1"),
        (2, grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_INVALID", "0 to 1; found 2"),  # the head
        (9, grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_INVALID", "0 to 1; found 9"),
    ],
)
async def test_revert_out_of_range_is_refused_and_writes_nothing(
    world: World, to_version: int, code: grpc.StatusCode, reason: str, message: str
) -> None:
    thread_id = await world.thread(3)
    before = await world.ledger.rows(thread_id)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await world.revert(thread_id, to_version, "k")
    assert refusal(refused.value) == (code, reason)
    assert refused.value.details() == f"to_version must be an earlier version, {message}"
    assert await world.ledger.rows(thread_id) == before


async def test_a_revert_restores_nothing_the_policy_in_force_refuses(
    world: World, policy_dir: Path, tmp_path: Path
) -> None:
    """A revert to a version written before a policy edit brought back a value the
    policy in force refuses (here a requested action the edited enum no longer holds),
    and its record named the edited policy: only the invariants were checked (found by
    review). The restored keys now pass the declared-key, schema and credential checks
    a proposal of them would, or the revert is refused and writes nothing."""
    needle = "action: {type: enum, values: [refund, cancel_order, lookup, update_address, none]}"
    edited = tmp_path / "edited"
    shutil.copytree(policy_dir, edited)
    text = (policy_dir / "pipeline.yaml").read_text()
    assert needle in text
    (edited / "pipeline.yaml").write_text(text.replace("[refund, ", "["))
    thread_id = new_thread_id()
    async with client(world.target, world.pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(world.target, world.pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("a1", "refund")})
    original = world.settings
    world.settings = original.model_copy(update={"policy_path": edited})
    await world.restart()
    try:
        async with client(world.target, world.pki.node("input-parser")) as parser:
            await parser.propose(thread_id, 1, {"requested_action": act("a2", "lookup")})
        before = await world.ledger.rows(thread_id)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await world.revert(thread_id, 1, "back-to-the-refund")
        assert refusal(refused.value) == (grpc.StatusCode.INVALID_ARGUMENT, "SCHEMA_VIOLATION")
        assert "requested_action" in (refused.value.details() or "")
        assert await world.ledger.rows(thread_id) == before
        # a revert to what the policy in force allows still commits
        reverted = await world.revert(thread_id, 0, "back-to-genesis")
        assert reverted.transition.version == 3
    finally:
        world.settings = original
        await world.restart()


async def test_revert_of_an_unknown_thread_is_not_found(world: World) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await world.revert("no-such-thread", 0, "k")
    assert refusal(refused.value) == (grpc.StatusCode.NOT_FOUND, "THREAD_NOT_FOUND")
    assert refused.value.details() == "thread 'no-such-thread' does not exist"


@pytest.mark.parametrize("who", ["node", "service"])
async def test_only_operators_may_revert(world: World, who: str) -> None:
    from ztate.services.runtime.identity import Role

    thread_id = await world.thread(2)
    before = await world.ledger.rows(thread_id)
    creds = (
        world.pki.node("input-parser")
        if who == "node"
        else world.pki.identity(Role.SERVICE, "approval")
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await world.revert(thread_id, 0, "k", creds)
    assert refusal(refused.value) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_FORBIDDEN")
    assert refused.value.details() == f"a {who} identity may not revert threads"
    assert await world.ledger.rows(thread_id) == before


async def test_cli_reverts_with_the_operator_certificate(world: World) -> None:
    thread_id = await world.thread(2)
    creds = world.pki.operator()
    flags = ["--target", world.target, "--cert", str(creds.cert), "--key", str(creds.key)]
    flags += ["--ca", str(creds.ca)]
    code, out, err = await run_cli("threads", "revert", thread_id, "--to", "0", *flags)
    assert (code, err) == (0, "")
    rows = await world.ledger.rows(thread_id)
    assert out == (
        f"thread {thread_id} reverted to the state of version 0: new version 2, "
        f"digest {rows[2]['digest']}, by {OPERATOR}\n"
    )
    code, out, err = await run_cli("threads", "revert", thread_id, "--to", "5", *flags)
    assert (code, out) == (2, "")  # INVALID_ARGUMENT: the CLI's usage exit code
    assert err == (
        "ztate: REQUEST_INVALID: to_version must be an earlier version, 0 to 1; found 5\n"
    )
    assert len(await world.ledger.rows(thread_id)) == 3


# --- retention --------------------------------------------------------------------------


def without_state(rows: list[asyncpg.Record]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "state"} for row in rows]


async def test_prune_keeps_every_record_and_the_chain_verifies(world: World) -> None:
    thread_id = await world.thread(5)
    before = await world.ledger.rows(thread_id)

    pruned = await prune(world.dsn, Limits(keep_versions=2), thread_id=thread_id)

    rows = await world.ledger.rows(thread_id)
    assert pruned == 3
    assert without_state(rows) == without_state(before)
    assert [r["state"] is None for r in rows] == [True, True, True, False, False]
    assert [r["state"] for r in rows[3:]] == [r["state"] for r in before[3:]]
    assert await world.ledger.verify(thread_id) == 5
    assert await world.verify_all(thread_id) == ([], 5, 0)
    # pruning again finds nothing more to prune
    assert await prune(world.dsn, Limits(keep_versions=2), thread_id=thread_id) == 0


async def test_prune_by_age_and_the_head_is_always_kept(world: World) -> None:
    thread_id = await world.thread(3)
    young = Limits(older_than=timedelta(days=1))
    assert await prune(world.dsn, young, thread_id=thread_id) == 0
    both = Limits(keep_versions=1, older_than=timedelta(days=1))
    assert await prune(world.dsn, both, thread_id=thread_id) == 0
    assert await prune(world.dsn, Limits(older_than=timedelta(0)), thread_id=thread_id) == 2
    rows = await world.ledger.rows(thread_id)
    assert [r["state"] is None for r in rows] == [True, True, False]
    assert await world.verify_all(thread_id) == ([], 3, 0)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({}, "give --keep-versions, --older-than or both"),
        ({"keep_versions": 0}, "--keep-versions must be at least 1 (the head is always kept)"),
        ({"older_than": timedelta(days=-1)}, "--older-than must not be negative"),
    ],
)
def test_unusable_limits_are_refused(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(RetentionError) as refused:
        Limits(**limits)
    assert str(refused.value) == message


async def test_revert_to_a_pruned_version_is_state_pruned(world: World) -> None:
    thread_id = await world.thread(3)
    assert await prune(world.dsn, Limits(keep_versions=2), thread_id=thread_id) == 1
    before = await world.ledger.rows(thread_id)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await world.revert(thread_id, 0, "undo-pruned")
    assert refusal(refused.value) == (grpc.StatusCode.FAILED_PRECONDITION, "STATE_PRUNED")
    assert refused.value.details() == (
        "the state of version 0 was pruned by retention; it cannot be restored"
    )
    assert await world.ledger.rows(thread_id) == before
    done = await world.revert(thread_id, 1, "undo-kept")  # a kept state still restores
    assert done.transition.version == 3


REFUSED_EVEN_TO_A_SUPERUSER = [
    ("UPDATE ztate.transitions SET node_id = 'x' WHERE thread_id = $1 AND version = 0", "append"),
    (
        "UPDATE ztate.transitions SET state = NULL, node_id = 'x' WHERE thread_id = $1 "
        "AND version = 1",
        "append",
    ),
    (
        "UPDATE ztate.transitions SET state = '\\x7b7d'::bytea WHERE thread_id = $1 "
        "AND version = 0",
        "append",
    ),
    (
        "UPDATE ztate.transitions SET state = '\\x7b7d'::bytea WHERE thread_id = $1 "
        "AND version = 1",
        "append",
    ),
    ("UPDATE ztate.transitions SET state = NULL WHERE thread_id = $1 AND version = 2", "head"),
    ("DELETE FROM ztate.transitions WHERE thread_id = $1 AND version = 0", "append"),
]


@pytest.mark.parametrize(("statement", "why"), REFUSED_EVEN_TO_A_SUPERUSER)
async def test_the_trigger_allows_only_pruning_a_state_body(
    world: World, statement: str, why: str
) -> None:
    thread_id = await world.thread(3)
    assert await prune(world.dsn, Limits(keep_versions=2), thread_id=thread_id) == 1
    before = await world.ledger.rows(thread_id)
    conn = await asyncpg.connect(world.dsn)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError) as refused:
            await conn.execute(statement, thread_id)
    finally:
        await conn.close()
    expected = (
        "the state of a thread's head is never pruned"
        if why == "head"
        else "the ledger is append-only (only pruning a state body to NULL is allowed)"
    )
    assert expected in str(refused.value)
    assert await world.ledger.rows(thread_id) == before


@pytest.mark.parametrize(
    ("role", "statement"),
    [
        ("ztate_pruner", "UPDATE ztate.transitions SET node_id = 'x' WHERE thread_id = $1"),
        ("ztate_pruner", "DELETE FROM ztate.transitions WHERE thread_id = $1"),
        ("ztate_pruner", "UPDATE ztate.threads SET state = '\\x7b7d' WHERE thread_id = $1"),
        ("ztate_pruner", "SELECT record FROM ztate.transitions WHERE thread_id = $1"),
        ("ztate_transition", "UPDATE ztate.transitions SET state = NULL WHERE thread_id = $1"),
    ],
)
async def test_roles_hold_only_their_privileges(world: World, role: str, statement: str) -> None:
    thread_id = await world.thread(3)
    before = await world.ledger.rows(thread_id)
    conn = await asyncpg.connect(world.dsn, server_settings={"role": role})
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError) as refused:
            await conn.execute(statement, thread_id)
    finally:
        await conn.close()
    assert "permission denied" in str(refused.value)
    assert await world.ledger.rows(thread_id) == before


# in one order on every lane (Citus returns the shards' rows in any order)
LEDGER_IN_ORDER = "SELECT thread_id, version, state FROM ztate.transitions ORDER BY 1, 2"


async def test_cli_prunes_the_database(world: World) -> None:
    thread_id = await world.thread(2)
    heads = await world.fetch("SELECT thread_id, version FROM ztate.threads")
    env = {"DATABASE_URL": world.dsn, "ZTATE_HOME": str(world.settings.home)}
    before = await world.fetch(LEDGER_IN_ORDER)
    # --dry-run counts, changes nothing
    code, out, err = await run_cli("ledger", "prune", "--keep-versions", "1", "--dry-run", env=env)
    assert (code, err) == (0, "")
    would = int(out.removeprefix("would prune ").split()[0])
    assert would > 0
    assert out == f"would prune {would} state bodies (dry run: nothing changed)\n"
    assert await world.fetch(LEDGER_IN_ORDER) == before
    # irreversible: not on a terminal and without --yes, it refuses, and changes nothing
    code, out, err = await run_cli("ledger", "prune", "--keep-versions", "1", env=env)
    assert (code, out) == (2, "")
    assert err == (
        f"ztate: ledger prune would drop {would} state bodies for good: confirm with --yes "
        "(or look first with --dry-run)\n"
    )
    assert await world.fetch(LEDGER_IN_ORDER) == before
    # on a terminal it asks; "n" keeps everything
    code, out, err = await prune_on_a_terminal(env, answer=b"n\n")
    assert (code, out) == (0, "")
    assert f"Prune {would} state bodies (records and digests stay)? [y/N]" in err
    assert err.endswith("nothing pruned\n")
    assert await world.fetch(LEDGER_IN_ORDER) == before
    code, out, err = await run_cli("ledger", "prune", "--keep-versions", "1", "--yes", env=env)
    assert (code, err) == (0, "")
    assert out == f"pruned {would} state bodies; every record, digest and signature is kept\n"
    kept = await world.fetch(
        "SELECT thread_id, version FROM ztate.transitions WHERE state IS NOT NULL"
    )
    assert sorted(map(tuple, kept)) == sorted(map(tuple, heads))
    assert (await states(world, thread_id))[0] is None
    code, out, err = await run_cli("ledger", "prune", env=env)
    assert (code, out) == (2, "")
    assert err == "ztate: ledger prune: give --keep-versions, --older-than or both\n"


async def test_prune_and_export_say_in_one_line_that_the_database_failed(
    tmp_path: Path,
) -> None:
    """A database that refuses the connection, and a DATABASE_URL the driver cannot
    parse: ``ledger prune`` and ``ledger export`` printed a traceback (55 lines, exit
    1). Now one line, the password never in it: exit 4 for a database out of reach,
    exit 2 for an export that cannot run."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        port = held.getsockname()[1]
        refused = {
            "DATABASE_URL": f"postgresql://ztate:s3cret-pw@127.0.0.1:{port}/ztate",
            "ZTATE_HOME": str(tmp_path / "home"),
        }
        code, out, err = await run_cli("ledger", "prune", "--keep-versions", "1", env=refused)
        assert (code, out) == (4, "")
        assert err.startswith("ztate: ledger prune: the database is not reachable: ")
        assert err.count("\n") == 1
        assert "s3cret-pw" not in err
        assert "Traceback" not in err
    finally:
        held.close()
    malformed = {
        "DATABASE_URL": "postgresql://ztate:s3cret-pw@127.0.0.1:notaport/ztate",
        "ZTATE_HOME": str(tmp_path / "home"),
    }
    code, out, err = await run_cli("ledger", "export", "--out", str(tmp_path / "b"), env=malformed)
    assert (code, out) == (2, "")
    assert err.startswith("ztate ledger export: cannot connect to the database: ")
    assert err.count("\n") == 1
    assert "s3cret-pw" not in err
    assert not (tmp_path / "b").exists()
