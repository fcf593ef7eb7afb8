"""The run: set everything up, measure, print the report, tear everything down.

The closed-loop measurements interleave (floor, ceiling, ztate at one
concurrency, then the next concurrency) and the whole sequence runs in rounds.
Other load on a shared machine can only slow a measurement down, so the report
keeps each measurement's fastest round, and prints every round's figure and the
CPU others used beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import uvloop

from bench import cpu
from bench.ceiling import (
    echo_once,
    echo_server,
    measure_ceiling,
    measure_structural,
    structural_once,
    structural_server,
)
from bench.end_to_end import health_check, measure_ztate, ztate_service
from bench.environment import (
    ChildServer,
    Database,
    Pki,
    bench_database,
    make_keyring,
    make_pki,
    postgres_server,
    temporary_folder,
    wait_until_serving,
)
from bench.floor import CommitPayload, commit_payload, measure_floor
from bench.langgraph_graph import measure as measure_langgraph_graph
from bench.langgraph_saver import measure_langgraph
from bench.ledger_queries import measure_ledger_queries
from bench.machine import describe
from bench.memory import measure_memory
from bench.pipeline_cpu import CpuTable, measure_pipeline_cpu
from bench.report import (
    CEILING,
    FLOOR,
    LANGGRAPH,
    LANGGRAPH_SHARED,
    STRUCTURAL,
    ZTATE,
    Measured,
    Report,
    render,
)
from bench.verify import measure_verification
from bench.workload import DEFAULT_POLICY, INITIAL_STATE, WRITTEN_KEY, receipt_patch
from ztate.contract.keyring import Keyring
from ztate.services.policy.model import Policy
from ztate.services.runtime.config import Settings
from ztate.worker_sdk import encode_json

DB_ROLE: str = Settings.model_fields["db_role"].default
DB_READER_ROLE: str = Settings.model_fields["db_reader_role"].default
SERVICE_POOL_SIZE: int = Settings.model_fields["db_pool_size"].default
SERVICE_HEAD_CACHE: int = Settings.model_fields["head_cache_size"].default


@dataclass(frozen=True)
class Options:
    duration: float
    warmup: float
    concurrency: tuple[int, ...]
    rounds: int
    patch_bytes: int
    only: str | None = None  # one part of the suite ("verify"), or None for all of it
    ztate_workers: int = 1


class Window(TypedDict):
    warmup: float
    duration: float


@dataclass(frozen=True)
class Servers:
    echo: ChildServer
    ztate: ChildServer
    structural: ChildServer


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="ztate's benchmarks, as ratios within one run"
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured (5)")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds discarded (1.5)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 32, 128], help="workers (1 32 128)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best counts (3)")
    parser.add_argument("--patch-bytes", type=int, default=1024, help="patch size (1024)")
    parser.add_argument(
        "--only",
        choices=["end-to-end", "verify", "ledger-queries", "langgraph"],
        help="run one part alone: end-to-end (commits/s against the floor, the ceiling and "
        "LangGraph, pipeline CPU, memory at 10,000 threads), verify (verification "
        "throughput), ledger-queries (operator query latency on 1,000,000 transitions), langgraph "
        "(checkpoint put/get and per-step cost of a graph run: the ztate checkpointer and "
        "node isolation against AsyncPostgresSaver)",
    )
    parser.add_argument("--ztate-workers", type=int, default=1, help="ztate serve --workers N (1)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.rounds < 1 or min(args.concurrency) < 1:
        parser.error("duration must be > 0, warm-up >= 0, rounds and concurrencies >= 1")
    return Options(
        args.duration,
        args.warmup,
        tuple(args.concurrency),
        args.rounds,
        args.patch_bytes,
        args.only,
        max(1, args.ztate_workers),
    )


def progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


async def start_servers(
    stack: AsyncExitStack,
    root: Path,
    database: Database,
    pki: Pki,
    keyring_file: Path,
    workers: int = 1,
) -> Servers:
    echo = stack.enter_context(echo_server(pki, root / "echo-server.log"))
    structural = stack.enter_context(
        structural_server(
            pki,
            root / "structural-server.log",
            dsn=database.dsn,
            role=DB_ROLE,
            pool_size=SERVICE_POOL_SIZE,
            keyring_file=keyring_file,
        )
    )
    ztate = stack.enter_context(
        ztate_service(
            dsn=database.dsn,
            home=root / "home",
            pki=pki,
            keyring_file=keyring_file,
            log=root / "ztate-serve.log",
            workers=workers,
        )
    )
    await wait_until_serving(echo, lambda: echo_once(echo.target, pki.worker))
    await wait_until_serving(ztate, lambda: health_check(ztate.target, pki.operator))
    await wait_until_serving(structural, lambda: structural_once(structural.target, pki.worker))
    return Servers(echo, ztate, structural)


async def measure_at(
    concurrency: int,
    options: Options,
    *,
    database: Database,
    servers: Servers,
    pki: Pki,
    payload: CommitPayload,
    patch_json: bytes,
    state: dict[str, Any],
) -> list[Measured]:
    """Floor, ceiling, structural ceiling, ztate and LangGraph (a saver per worker, then
    one shared saver) at one concurrency, one after the other."""
    client = {"client": cpu.this_process()}
    postgres = (
        {"postgres": cpu.process_tree(database.postmaster_pid)} if database.postmaster_pid else {}
    )
    window = Window(warmup=options.warmup, duration=options.duration)
    floor = await measure_floor(
        database.dsn,
        payload,
        role=DB_ROLE,
        pool_size=SERVICE_POOL_SIZE,
        concurrency=concurrency,
        meters=client | postgres,
        **window,
    )
    ceiling = await measure_ceiling(
        servers.echo,
        pki.worker,
        patch_json,
        concurrency=concurrency,
        meters=client | {"server": cpu.process(servers.echo.process.pid)},
        **window,
    )
    structural = await measure_structural(
        servers.structural,
        pki.worker,
        database.dsn,
        payload,
        patch_json,
        role=DB_ROLE,
        concurrency=concurrency,
        meters=client | {"server": cpu.process(servers.structural.process.pid)} | postgres,
        **window,
    )
    ztate = await measure_ztate(
        servers.ztate,
        pki,
        patch_json,
        concurrency=concurrency,
        meters=client | {"server": cpu.process_tree(servers.ztate.process.pid)} | postgres,
        **window,
    )
    langgraph = await measure_langgraph(
        database.dsn,
        state,
        WRITTEN_KEY,
        pool_size=SERVICE_POOL_SIZE,
        concurrency=concurrency,
        meters=client | postgres,
        **window,
    )
    langgraph_shared = await measure_langgraph(
        database.dsn,
        state,
        WRITTEN_KEY,
        pool_size=SERVICE_POOL_SIZE,
        shared=True,
        concurrency=concurrency,
        meters=client | postgres,
        **window,
    )
    return [
        Measured(FLOOR, floor),
        Measured(CEILING, ceiling),
        Measured(STRUCTURAL, structural),
        Measured(ZTATE, ztate),
        Measured(LANGGRAPH, langgraph),
        Measured(LANGGRAPH_SHARED, langgraph_shared),
    ]


def setup_lines(options: Options, database: Database, patch_json: bytes) -> list[str]:
    where = "DATABASE_URL" if database.postmaster_pid is None else "embedded"
    return [
        f"database  PostgreSQL {database.server_version} ({where}), {database.durability}",
        f"method    closed loop per worker, {options.warmup:g} s warm-up then "
        f"{options.duration:g} s measured, best of {options.rounds} interleaved rounds; "
        f"patch and echo payload {len(patch_json):,} B; one mTLS channel per worker",
        f"service   ztate serve --workers {options.ztate_workers}, otherwise its defaults: db "
        f"pool {SERVICE_POOL_SIZE}, head cache "
        f"{SERVICE_HEAD_CACHE}; floor pool {SERVICE_POOL_SIZE}, same role and reset hook",
        f"structural grpc.aio mTLS server whose handler runs the store's COMMIT statement "
        f"(pool {SERVICE_POOL_SIZE}) and answers: one RPC + one commit, nothing of ztate",
        f"langgraph AsyncPostgresSaver.aput of the same state over one psycopg pool of "
        f"{SERVICE_POOL_SIZE}: a saver per worker, and one shared saver (its default wiring)",
    ]


async def run(options: Options) -> Report:
    """Everything, in order; whatever was started is stopped on the way out."""
    current = asyncio.current_task()
    assert current is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, current.cancel)
    machine = describe()
    async with AsyncExitStack() as stack:
        root = stack.enter_context(temporary_folder())
        keyring_file = make_keyring(root)
        keyring = Keyring.load(keyring_file, None)
        policy = Policy.load(DEFAULT_POLICY)
        progress("pipeline CPU per proposal")
        pipeline: CpuTable = measure_pipeline_cpu(DEFAULT_POLICY, keyring)

        progress("starting Postgres, PKI, echo server and ztate serve")
        server_dsn, postmaster_pid = stack.enter_context(postgres_server(root))
        database = await stack.enter_async_context(
            bench_database(server_dsn, postmaster_pid, DB_ROLE)
        )
        pki = make_pki(root / "pki")
        servers = await start_servers(
            stack, root, database, pki, keyring_file, options.ztate_workers
        )

        patch = receipt_patch(options.patch_bytes)
        patch_json = encode_json(patch)
        payload = commit_payload(patch, keyring, policy.digest)
        measured: list[Measured] = []
        for round_number in range(1, options.rounds + 1):
            for concurrency in options.concurrency:
                progress(f"round {round_number} of {options.rounds}, c={concurrency}")
                measured += await measure_at(
                    concurrency,
                    options,
                    database=database,
                    servers=servers,
                    pki=pki,
                    payload=payload,
                    patch_json=patch_json,
                    state=INITIAL_STATE | patch,
                )
        memory_lines: list[str] = []
        if options.ztate_workers == 1:  # the resident set of one process
            progress("memory at 10,000 active threads")
            memory = await measure_memory(servers.ztate, pki, SERVICE_HEAD_CACHE)
            memory_lines = memory.lines()
        progress("stopping servers")
    return Report(
        machine, setup_lines(options, database, patch_json), measured, pipeline, memory_lines
    )


async def run_verify() -> list[str]:
    """``--only verify``: verification throughput in a database of its own."""
    current = asyncio.current_task()
    assert current is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, current.cancel)
    machine = describe()
    async with AsyncExitStack() as stack:
        root = stack.enter_context(temporary_folder())
        keyring_file = make_keyring(root)
        progress("starting Postgres")
        server_dsn, postmaster_pid = stack.enter_context(postgres_server(root))
        database = await stack.enter_async_context(
            bench_database(server_dsn, postmaster_pid, DB_ROLE)
        )
        figures = await measure_verification(
            database.dsn, root, keyring_file, progress, database.postmaster_pid
        )
    where = "DATABASE_URL" if database.postmaster_pid is None else "embedded"
    return [
        *machine.lines(),
        f"database  PostgreSQL {database.server_version} ({where})",
        "",
        *figures.lines(),
    ]


async def run_ledger_queries() -> list[str]:
    """``--only ledger-queries``: operator query latency in a database of its own."""
    current = asyncio.current_task()
    assert current is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, current.cancel)
    machine = describe()
    async with AsyncExitStack() as stack:
        root = stack.enter_context(temporary_folder())
        progress("starting Postgres")
        server_dsn, postmaster_pid = stack.enter_context(postgres_server(root))
        database = await stack.enter_async_context(
            bench_database(server_dsn, postmaster_pid, DB_ROLE)
        )
        figures = await measure_ledger_queries(database.dsn, DB_ROLE, DB_READER_ROLE, progress)
    where = "DATABASE_URL" if database.postmaster_pid is None else "embedded"
    return [
        *machine.lines(),
        f"database  PostgreSQL {database.server_version} ({where}), {database.durability}",
        "",
        *figures.lines(),
    ]


async def run_langgraph() -> list[str]:
    """``--only langgraph``: LangGraph on ztate against AsyncPostgresSaver, in a database
    and a ``ztate serve`` of its own."""
    current = asyncio.current_task()
    assert current is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, current.cancel)
    machine = describe()
    return [*machine.lines(), "", *await measure_langgraph_graph(progress)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite (or one part) and print the report; 130 when interrupted."""
    options = parse_args(argv)
    try:
        if options.only in (None, "end-to-end"):
            print(render(uvloop.run(run(options))), flush=True)
        if options.only in (None, "verify"):
            print("\n".join(["", *uvloop.run(run_verify())]), flush=True)
        if options.only in (None, "ledger-queries"):
            print("\n".join(["", *uvloop.run(run_ledger_queries())]), flush=True)
        if options.only in (None, "langgraph"):
            print("\n".join(["", *uvloop.run(run_langgraph())]), flush=True)
    except (KeyboardInterrupt, asyncio.CancelledError):
        progress("interrupted; everything started was stopped")
        return 130
    return 0
