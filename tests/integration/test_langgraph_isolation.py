"""LangGraph node isolation, through the example of examples/langgraph_pipeline/: the
four-node pipeline as a ``StateGraph``, each node a worker process of its own with its
own certificate, against a real control plane (the testing kit: real Postgres, real
mTLS). Isolated nodes see only their projections; the prompt-injected parser's update is
refused whole (``KEY_NOT_WRITABLE``), leaving the ledger unchanged and a rejection row;
the approval gate's risky update commits only after a reviewer approved it."""

from __future__ import annotations

import importlib
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from ztate.langgraph import IsolatedGraph, NodeUpdateNotApproved, NodeUpdateRefused, Parked
from ztate.testing import TRUST_DOMAIN, LedgerSnapshot, ZtateEnvironment
from ztate.worker_sdk import AwaitingApproval

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_pipeline"
sys.path.insert(0, str(EXAMPLE))
example: Any = importlib.import_module("run")
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
    """What the test's reviewer saw and did when an update was parked."""

    env: ZtateEnvironment
    parked: list[Parked] = field(default_factory=list)
    ledger_when_parked: list[LedgerSnapshot] = field(default_factory=list)
    heads_when_parked: list[dict[str, Any]] = field(default_factory=list)

    reject: bool = False  # the reviewer's decision on the next parked update

    async def __call__(self, parked: Parked) -> None:
        self.parked.append(parked)
        snapshot = await self.env.ledger.snapshot(parked.thread_id)
        self.ledger_when_parked.append(snapshot)
        assert snapshot.head_version is not None
        self.heads_when_parked.append(
            await self.env.ledger.record(parked.thread_id, snapshot.head_version)
        )
        awaiting = AwaitingApproval(
            parked.digest, parked.thread_id, parked.base_version, parked.risk_rules, parked.handle
        )
        if self.reject:
            self.reject = False
            await self.env.reject(awaiting)
        else:
            await self.env.approve(awaiting)


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
    async with ZtateEnvironment.start(postgres_dsn=postgres_server_dsn) as env:
        approvals = Approvals(env)
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
