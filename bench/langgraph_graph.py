"""``--only langgraph``: LangGraph on ztate against LangGraph on its own Postgres saver.

All in one run, on one Postgres server (the service's database and LangGraph's tables
side by side) and one ``ztate serve`` child process loading the pipeline policy of
docs/policy.md and the checkpointer's policy (``ztate.langgraph.checkpoint_policy``):

1. **Checkpoint put and get**, one after the other on one thread (latency, not
   throughput): ``ZtateCheckpointSaver.aput`` / ``aget_tuple`` against
   ``AsyncPostgresSaver.aput`` / ``aget_tuple``. A ztate put is a signed, chained
   transition proposed over mTLS; a get verifies the new records since the last one.
2. **A graph run end to end, per step**: the four-node pipeline of
   examples/langgraph_pipeline (a refund of 12.99 with the permission already
   granted, so no step waits for a reviewer), run on a fresh thread each time:
   plain LangGraph in memory (no checkpointer), with ``AsyncPostgresSaver``, with
   ``ZtateCheckpointSaver``, and isolated under ztate (each node a worker process
   with its own certificate, ``ztate.langgraph.isolate``). Per step = run / 4.

Medians over the runs, interleaved so that a burst of load on a shared machine hits
every variant alike; the load average before and after is printed beside them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from bench.end_to_end import health_check, ztate_service
from bench.environment import (
    REPO,
    Credentials,
    bench_database,
    issue_identity,
    make_keyring,
    make_pki,
    postgres_server,
    temporary_folder,
    wait_until_serving,
)
from bench.workload import DEFAULT_POLICY
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Role
from ztate.worker_sdk import ZtateClient

EXAMPLE = REPO / "examples" / "langgraph_pipeline"
NODES = ("input-parser", "planner", "approval-gate", "db-writer")
TEXT = "Please refund order A-17 for 12.99, it arrived broken."
PUT_GET_OPS = 200
GRAPH_RUNS = 15


def initial_state() -> dict[str, Any]:
    return {
        "authority": {"tenant": "acme", "acting_for": "support desk"},
        "target_user_id": "123e4567-e89b-42d3-a456-426614174000",
        "execution_permissions": ["read_orders", "refund"],
        "raw_text": TEXT,
    }


@dataclass
class Timings:
    label: str
    seconds: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1000

    @property
    def p90_ms(self) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] * 1000


async def timed(call: Awaitable[Any]) -> float:
    """Seconds to await ``call`` (a coroutine runs only once awaited)."""
    began = time.perf_counter()
    await call
    return time.perf_counter() - began


def client(target: str, credentials: Credentials) -> ZtateClient:
    return ZtateClient.from_files(
        target, cert=credentials.cert, key=credentials.key, ca=credentials.ca
    )


async def put_get(
    ztate_saver: Any, postgres_saver: Any, ops: int
) -> tuple[Timings, Timings, Timings, Timings]:
    """``ops`` puts on one thread, then ``ops`` gets of its latest checkpoint, each saver
    in turn operation by operation."""
    from langgraph.checkpoint.base import empty_checkpoint

    timings = {name: Timings(name, []) for name in ("zput", "pput", "zget", "pget")}
    configs: dict[str, Any] = {}
    for name in ("z", "p"):
        configs[name] = {
            "configurable": {"thread_id": f"bench-{uuid.uuid4().hex}", "checkpoint_ns": ""}
        }
        configs[name + "-latest"] = {"configurable": dict(configs[name]["configurable"])}
    for step in range(ops):
        for name, saver in (("z", ztate_saver), ("p", postgres_saver)):
            checkpoint = empty_checkpoint()
            checkpoint["channel_values"] = {"answer": f"step {step}", "count": step}
            checkpoint["channel_versions"] = {"answer": step + 1, "count": step + 1}
            metadata = {"source": "loop", "step": step, "parents": {}}
            began = time.perf_counter()
            configs[name] = await saver.aput(
                configs[name], checkpoint, metadata, {"answer": step + 1, "count": step + 1}
            )
            timings[name + "put"].seconds.append(time.perf_counter() - began)
    for _ in range(ops):
        for name, saver in (("z", ztate_saver), ("p", postgres_saver)):
            latest = configs[name + "-latest"]
            timings[name + "get"].seconds.append(await timed(saver.aget_tuple(latest)))
    return timings["zput"], timings["pput"], timings["zget"], timings["pget"]


async def measure(progress: Callable[[str], None]) -> list[str]:
    """Everything of ``--only langgraph``; returns the report's lines."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    from ztate.langgraph import (
        CHECKPOINTER_NODE,
        NodeWorker,
        ZtateCheckpointSaver,
        checkpoint_policy,
        isolate,
    )

    sys.path.insert(0, str(EXAMPLE))
    from support_graph import build  # the example's StateGraph, as its workers import it

    load_before = os.getloadavg()
    async with AsyncExitStack() as stack:
        root = stack.enter_context(temporary_folder())
        keyring_file = make_keyring(root)
        progress("starting Postgres and ztate serve")
        server_dsn, postmaster_pid = stack.enter_context(postgres_server(root))
        database = await stack.enter_async_context(
            bench_database(server_dsn, postmaster_pid, Settings.model_fields["db_role"].default)
        )
        pki = make_pki(root / "pki")
        identities = {
            node: issue_identity(root / "pki", Role.NODE, node)
            for node in (*NODES, CHECKPOINTER_NODE)
        }
        policies = root / "policies"
        policies.mkdir()
        (policies / "pipeline.yaml").write_bytes(DEFAULT_POLICY.read_bytes())
        (policies / "checkpoints.json").write_text(json.dumps(checkpoint_policy()))
        service = stack.enter_context(
            ztate_service(
                dsn=database.dsn,
                home=root / "home",
                pki=pki,
                keyring_file=keyring_file,
                log=root / "ztate-serve.log",
                policy_path=policies,
                extra_env={"ZTATE_MAX_PATCH_BYTES": str(1024 * 1024)},
            )
        )
        await wait_until_serving(service, lambda: health_check(service.target, pki.operator))
        operator = client(service.target, pki.operator)
        stack.push_async_callback(operator.close)
        saver_node = client(service.target, identities[CHECKPOINTER_NODE])
        stack.push_async_callback(saver_node.close)
        ztate_saver = ZtateCheckpointSaver(saver_node, operator)

        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            database.dsn,
            min_size=4,
            max_size=4,
            open=False,
            kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        )
        await pool.open(wait=True)
        stack.push_async_callback(pool.close)
        postgres_saver = AsyncPostgresSaver(pool)
        await postgres_saver.setup()

        progress(f"checkpoint put/get, {PUT_GET_OPS} of each per saver")
        zput, pput, zget, pget = await put_get(ztate_saver, postgres_saver, PUT_GET_OPS)

        progress("starting the four node workers")
        workers = {
            node: NodeWorker(node, creds.cert, creds.key, creds.ca)
            for node, creds in identities.items()
            if node in NODES
        }
        isolated = await stack.enter_async_context(
            isolate(
                build(),
                workers,
                target=service.target,
                operator=operator,
                policy="pipeline",
                cwd=EXAMPLE,
            )
        )
        plain = build().compile()
        on_postgres = build().compile(checkpointer=postgres_saver)
        on_ztate = build().compile(checkpointer=ztate_saver)
        runs = {
            "plain LangGraph, in memory": Timings("plain", []),
            "LangGraph + AsyncPostgresSaver": Timings("postgres", []),
            "LangGraph + ZtateCheckpointSaver": Timings("ztate-saver", []),
            "isolated under ztate (4 worker processes)": Timings("isolated", []),
        }
        progress(f"graph runs, {GRAPH_RUNS} of each variant")
        for _ in range(GRAPH_RUNS + 1):  # the first round warms up and is dropped
            thread = {"configurable": {"thread_id": f"bench-{uuid.uuid4().hex[:16]}"}}
            figures = [
                await timed(plain.ainvoke(initial_state(), thread)),
                await timed(on_postgres.ainvoke(initial_state(), thread)),
                await timed(on_ztate.ainvoke(initial_state(), thread)),
                await timed(isolated.ainvoke(initial_state(), thread)),
            ]
            for timings, seconds in zip(runs.values(), figures, strict=True):
                timings.seconds.append(seconds)
        for timings in runs.values():
            del timings.seconds[0]
        progress("stopping")
    load_after = os.getloadavg()
    return report(zput, pput, zget, pget, runs, load_before, load_after, database.server_version)


def report(
    zput: Timings,
    pput: Timings,
    zget: Timings,
    pget: Timings,
    runs: dict[str, Timings],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    server_version: str,
) -> list[str]:
    lines = [
        f"LangGraph on ztate (PostgreSQL {server_version}; one operation at a time; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, "
        f"on {os.cpu_count()} CPUs)",
        "",
        f"checkpoint put/get, {len(zput.seconds)} each     median ms   p90 ms",
    ]
    for label, timings in (
        ("put  ZtateCheckpointSaver", zput),
        ("put  AsyncPostgresSaver", pput),
        ("get  ZtateCheckpointSaver", zget),
        ("get  AsyncPostgresSaver", pget),
    ):
        lines.append(f"  {label:<34} {timings.median_ms:9.2f} {timings.p90_ms:8.2f}")
    lines += [
        f"  ratio ztate / postgres: put {zput.median_ms / pput.median_ms:.1f}x, "
        f"get {zget.median_ms / pget.median_ms:.1f}x",
        "",
        f"graph run, four-node pipeline, {GRAPH_RUNS} runs   run ms   per step ms",
    ]
    base = runs["plain LangGraph, in memory"].median_ms
    postgres = runs["LangGraph + AsyncPostgresSaver"].median_ms
    for label, timings in runs.items():
        lines.append(
            f"  {label:<42} {timings.median_ms:8.1f} {timings.median_ms / len(NODES):9.2f}"
        )
    ztate_saver = runs["LangGraph + ZtateCheckpointSaver"].median_ms
    isolated = runs["isolated under ztate (4 worker processes)"].median_ms
    lines += [
        f"  per-step overhead over in-memory: AsyncPostgresSaver "
        f"{(postgres - base) / len(NODES):.2f} ms, ZtateCheckpointSaver "
        f"{(ztate_saver - base) / len(NODES):.2f} ms, "
        f"isolated {(isolated - base) / len(NODES):.2f} ms",
        f"  ratio to AsyncPostgresSaver: ZtateCheckpointSaver {ztate_saver / postgres:.1f}x, "
        f"isolated {isolated / postgres:.1f}x",
    ]
    return lines
