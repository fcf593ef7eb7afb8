"""LangGraph node isolation, through the example of examples/langgraph_pipeline/: the
four-node pipeline as a ``StateGraph``, each node a worker process of its own with its
own certificate, against a real control plane (the testing kit: real Postgres, real
mTLS). Isolated nodes see only their projections; the prompt-injected parser's update is
refused whole (``KEY_NOT_WRITABLE``), leaving the ledger unchanged and a rejection row;
the approval gate's risky update commits only after a reviewer approved it through the
approval service (its own process: the review opened by the transition service's outbox,
the reviewer's decision over mTLS, the signed receipt delivered back)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.faults import free_port
from ztate.langgraph import IsolatedGraph, NodeUpdateNotApproved, NodeUpdateRefused, Parked
from ztate.services.cli import ca
from ztate.services.runtime.identity import Identity, Role
from ztate.testing import TRUST_DOMAIN, LedgerSnapshot, ZtateEnvironment
from ztate.testing._pki import secure_channel
from ztate.v1 import approval_pb2, approval_pb2_grpc
from ztate.worker_sdk import AlreadyExists

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_pipeline"


def load_example() -> Any:
    """examples/langgraph_pipeline/run.py under a name of its own (it puts its folder on
    sys.path, so its workers and this module import ``support_graph`` alike)."""
    spec = importlib.util.spec_from_file_location("langgraph_pipeline_run", EXAMPLE / "run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example: Any = load_example()
support_graph: Any = importlib.import_module("support_graph")

# what docs/policy.md's pipeline lets each node read, of the keys present in the run
PROJECTIONS = {
    "input-parser": ["raw_text"],
    "planner": ["authority", "requested_action", "target_user_id"],
    "approval-gate": ["authority", "execution_permissions", "pending_transition", "target_user_id"],
    "db-writer": ["approved_action", "execution_permissions", "target_user_id"],
}


@dataclass
class Approvals:
    """The reviewer ``alice``: when an update is parked, she finds its review in the
    approval service and decides it. What the ledger held at that moment is kept."""

    env: ZtateEnvironment
    target: str
    parked: list[Parked] = field(default_factory=list)
    ledger_when_parked: list[LedgerSnapshot] = field(default_factory=list)
    heads_when_parked: list[dict[str, Any]] = field(default_factory=list)
    reviews: list[Any] = field(default_factory=list)
    reject: bool = False  # the reviewer's decision on the next parked update

    async def __call__(self, parked: Parked) -> None:
        self.parked.append(parked)
        snapshot = await self.env.ledger.snapshot(parked.thread_id)
        self.ledger_when_parked.append(snapshot)
        assert snapshot.head_version is not None
        self.heads_when_parked.append(
            await self.env.ledger.record(parked.thread_id, snapshot.head_version)
        )
        alice = self.env.credentials(Role.REVIEWER, "alice")
        async with secure_channel(self.target, alice) as channel:
            reviews = approval_pb2_grpc.ApprovalServiceStub(channel)

            async def opened() -> Any:
                found = await reviews.ListReviews(
                    approval_pb2.ListReviewsRequest(thread_id=parked.thread_id)
                )
                return found.reviews[0] if found.reviews else None

            review = await eventually(opened)  # the outbox delivers it within a moment
            self.reviews.append(review)
            decision = (
                approval_pb2.DECISION_REJECT if self.reject else approval_pb2.DECISION_APPROVE
            )
            self.reject = False
            await reviews.Decide(
                approval_pb2.DecideRequest(digest=review.digest, decision=decision)
            )


async def eventually(probe: Callable[[], Awaitable[Any]], within: float = 20.0) -> Any:
    """Re-check a real condition until it holds (bounded), and return its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (value := await probe()) is None:
        assert loop.time() < deadline, "condition did not hold in time"
        await asyncio.sleep(0.05)
    return value


@contextlib.asynccontextmanager
async def approval_service(env: ZtateEnvironment, port: int) -> AsyncIterator[str]:
    """``ztate approval-serve`` in its own process, on the environment's database, CA and
    approval signing key, delivering decisions to its transition service."""
    certs = env.home / "approval-certs"
    ca.issue(
        env.pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        certs,
        dns_names=("localhost",),
        ip_addresses=("127.0.0.1",),
    )
    variables = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    variables.update(
        DATABASE_URL=env.database_dsn,
        ZTATE_HOME=str(env.home / "approval-home"),
        ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
        ZTATE_APPROVAL_LISTEN=f"127.0.0.1:{port}",
        ZTATE_APPROVAL_TLS_CERT=str(certs / "service-approval.crt"),
        ZTATE_APPROVAL_TLS_KEY=str(certs / "service-approval.key"),
        ZTATE_APPROVAL_TLS_CA=str(certs / "ca.crt"),
        ZTATE_APPROVAL_SIGNING_KEY_FILE=str(env.approval_signing_key),
        ZTATE_APPROVAL_TRANSITION_TARGET=env.target,
        ZTATE_APPROVAL_OUTBOX_INTERVAL_SECONDS="0.2",
    )
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        "approval-serve",
        env=variables,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    stderr = process.stderr

    async def listening() -> None:
        while b"approval service listening on port" not in (line := await stderr.readline()):
            assert line, "the approval service exited before it listened"

    async def drain() -> None:
        while await stderr.readline():
            pass

    try:
        await asyncio.wait_for(listening(), 60)
        draining = asyncio.get_running_loop().create_task(drain())
        yield f"localhost:{port}"
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 30)
    await draining


@dataclass
class Running:
    env: ZtateEnvironment
    graph: IsolatedGraph
    approvals: Approvals
    trace: Path

    def traced(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.trace.read_text().splitlines()]


@pytest_asyncio.fixture(scope="module")
async def running(
    postgres_server_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Running]:
    trace = tmp_path_factory.mktemp("langgraph-isolation") / "trace.jsonl"
    port = free_port()
    async with (
        ZtateEnvironment.start(
            postgres_dsn=postgres_server_dsn,
            approval_target=f"localhost:{port}",
            outbox_interval_seconds=0.2,
        ) as env,
        approval_service(env, port) as target,
    ):
        approvals = Approvals(env, target)
        async with example.isolated(env, on_parked=approvals, trace=trace) as graph:
            yield Running(env, graph, approvals, trace)


def config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


async def test_plain_langgraph_lets_the_injected_parser_act_for_another_user() -> None:
    result = await example.run_plain(example.INJECTED, "plain")
    assert result["target_user_id"] == support_graph.ATTACKER
    assert result["result_ref"] == "orders://A-17/refund"


async def test_isolated_nodes_see_their_projections_and_the_risky_step_waits_for_approval(
    running: Running,
) -> None:
    running.trace.write_text("")
    thread = f"lg-{uuid.uuid4().hex[:12]}"
    result = await running.graph.ainvoke(example.initial_state(example.HONEST), config(thread))

    # the run finished, and its state is the ledger's
    assert result["result_ref"] == "orders://A-17/refund"
    assert result["execution_permissions"] == ["read_orders", "refund"]
    head = await running.env.ledger.record(thread, 4)
    assert head["patch"] == {"result_ref": "orders://A-17/refund"}

    # each node ran in its own worker process and was given only its projection
    traced = running.traced()
    assert [line["node"] for line in traced] == list(PROJECTIONS)
    pids = running.graph.pids()
    assert len(set(pids.values())) == 4
    assert os.getpid() not in pids.values()
    for line in traced:
        assert line["keys"] == PROJECTIONS[line["node"]], line["node"]
        assert line["pid"] == pids[line["node"]]

    # each update was committed under its node's own certificate
    for version, node in enumerate(PROJECTIONS, start=1):
        record = await running.env.ledger.record(thread, version)
        assert record["node_id"] == f"spiffe://{TRUST_DOMAIN}/node/{node}"
    assert await running.env.ledger.verify(thread) == 5

    # the approval gate's widening was parked: when the reviewer was asked, the ledger
    # stood at the planner's commit; it committed afterwards, under a receipt
    parked = [p for p in running.approvals.parked if p.thread_id == thread]
    assert [p.node for p in parked] == ["approval-gate"]
    index = running.approvals.parked.index(parked[0])
    when_parked = running.approvals.ledger_when_parked[index]
    assert (when_parked.head_version, when_parked.transitions) == (2, 3)
    assert running.approvals.heads_when_parked[index]["node_id"].endswith("/node/planner")
    gate = await running.env.ledger.record(thread, 3)
    assert gate["node_id"].endswith("/node/approval-gate")
    assert gate["patch"]["execution_permissions"] == ["read_orders", "refund"]
    rows = await running.env.ledger.rows(thread)
    receipts = [json.loads(bytes(row["receipt"])) if row["receipt"] else None for row in rows]
    assert [r is not None for r in receipts] == [False, False, False, True, False]
    assert receipts[3]["decision"] == "approve"
    assert receipts[3]["base_version"] == 2
    assert receipts[3]["reviewers"] == [f"spiffe://{TRUST_DOMAIN}/reviewer/alice"]
    review = running.approvals.reviews[index]
    assert review.node_id == f"spiffe://{TRUST_DOMAIN}/node/approval-gate"
    assert receipts[3]["transition_digest"] == review.digest
    assert [step.status for step in running.graph.steps[-4:]] == ["committed"] * 4


@pytest.mark.parametrize(
    ("text", "key"),
    [(example.INJECTED, "target_user_id"), (example.ADMIN, "is_admin")],
    ids=["new-target-user", "is-admin"],
)
async def test_the_injected_parser_is_refused_and_the_ledger_is_unchanged(
    running: Running, text: str, key: str
) -> None:
    running.trace.write_text("")
    thread = f"lg-{uuid.uuid4().hex[:12]}"
    with pytest.raises(NodeUpdateRefused) as refused:
        await running.graph.ainvoke(example.initial_state(text), config(thread))

    assert (refused.value.node, refused.value.reason, refused.value.keys) == (
        "input-parser",
        "KEY_NOT_WRITABLE",
        (key,),
    )
    assert "'input-parser'" in str(refused.value)
    assert key in str(refused.value)

    # nothing committed: the thread is at its genesis, and no later node ran
    genesis = await running.env.ledger.record(thread, 0)
    snapshot = await running.env.ledger.snapshot(thread)
    assert (snapshot.head_version, snapshot.transitions) == (0, 1)
    assert genesis["patch"] == example.initial_state(text)
    assert [line["node"] for line in running.traced()] == ["input-parser"]

    # one rejection row, naming the parser and the key, holding no patch
    rows = await running.env.ledger.rejections(thread)
    assert len(rows) == 1
    row = rows[0]
    assert (row["method"], row["reason"], list(row["keys"])) == (
        "ProposeTransition",
        "KEY_NOT_WRITABLE",
        [key],
    )
    assert row["node_id"] == f"spiffe://{TRUST_DOMAIN}/node/input-parser"
    assert row["base_version"] == 0
    assert support_graph.ATTACKER not in row["message"]


async def test_a_new_threads_run_asked_again_is_refused_not_run_again(running: Running) -> None:
    """ainvoke with an input creates the thread; asked again with the same input (a
    retry), CreateThread answers that the same operator created it (replayed) and the
    graph ran every node again on the advanced head while LangGraph started afresh from
    the input (found by review). It is refused THREAD_EXISTS, nothing run."""
    thread = f"lg-{uuid.uuid4().hex[:12]}"
    with pytest.raises(NodeUpdateRefused):  # the first run: the injected parser is refused
        await running.graph.ainvoke(example.initial_state(example.INJECTED), config(thread))
    running.trace.write_text("")
    with pytest.raises(AlreadyExists) as refused:
        await running.graph.ainvoke(example.initial_state(example.INJECTED), config(thread))
    assert refused.value.reason == "THREAD_EXISTS"
    assert "pass None as the input" in str(refused.value)
    assert running.traced() == []  # no node ran
    assert len(await running.env.ledger.rejections(thread)) == 1  # the first run's alone
    snapshot = await running.env.ledger.snapshot(thread)
    assert (snapshot.head_version, snapshot.transitions) == (0, 1)


async def test_a_risky_update_the_reviewer_rejects_stops_the_run_and_commits_nothing(
    running: Running,
) -> None:
    running.trace.write_text("")
    running.approvals.reject = True
    thread = f"lg-{uuid.uuid4().hex[:12]}"
    with pytest.raises(NodeUpdateNotApproved) as stopped:
        await running.graph.ainvoke(example.initial_state(example.HONEST), config(thread))

    assert (stopped.value.node, stopped.value.status) == ("approval-gate", "rejected")
    assert [p.thread_id for p in running.approvals.parked].count(thread) == 1
    # the ledger stands at the planner's commit; the database writer never ran
    snapshot = await running.env.ledger.snapshot(thread)
    assert (snapshot.head_version, snapshot.transitions) == (2, 3)
    assert [line["node"] for line in running.traced()] == [
        "input-parser",
        "planner",
        "approval-gate",
    ]
    assert running.graph.steps[-1].status == "rejected"
