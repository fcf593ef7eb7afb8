"""(d) What most users would pick instead: LangGraph's ``AsyncPostgresSaver``.

Each worker owns one LangGraph thread and writes, step after step, the same
state ztate's workers commit (the initial state plus the ~1 KB
``approval_receipt``), as a graph step that updated that one channel would:
``aput`` with a fresh checkpoint id, the previous checkpoint as parent and only
the updated channel in ``new_versions``. One saver per worker over one shared
psycopg pool the size of the service's: a single shared saver serialises every
write behind an asyncio lock (PERF_NOTES: 1,520/s against 3,490/s at c=32), so
this is LangGraph at its fastest.

It does what LangGraph does: no authentication, no validation, no
compare-and-swap on a version and no signature.

(f) The same with LangGraph's default wiring: one saver, compiled into the graph,
shared by every worker (``shared=True``); it serialises its writes behind its lock.

The tables are LangGraph's own
(``saver.setup()``), in the run's database, written as its owner.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from bench import cpu
from bench.loadgen import Operation, Sample, closed_loop

LABEL = "langgraph: AsyncPostgresSaver"
SHARED_LABEL = "langgraph: one shared saver"


class SaverWriter:
    """One worker: one LangGraph thread, one checkpoint per step."""

    def __init__(self, saver: Any, thread_id: str, state: Mapping[str, Any], key: str) -> None:
        self._saver = saver
        self._state = dict(state)
        self._key = key
        self._step = 0
        self._config: dict[str, Any] = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": ""}
        }

    async def commit(self) -> None:
        from langgraph.checkpoint.base import empty_checkpoint

        self._step += 1
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = dict(self._state)
        checkpoint["channel_versions"] = {name: 1 for name in self._state} | {self._key: self._step}
        self._config = await self._saver.aput(
            self._config,
            checkpoint,
            {"source": "loop", "step": self._step, "parents": {}},
            {self._key: self._step},
        )


async def measure_langgraph(
    dsn: str,
    state: Mapping[str, Any],
    key: str,
    *,
    pool_size: int,
    shared: bool = False,
    concurrency: int,
    warmup: float,
    duration: float,
    meters: Mapping[str, cpu.CpuMeter],
) -> Sample:
    """One closed-loop run of ``aput``, ``concurrency`` workers on fresh threads, each with
    a saver of its own or (``shared``) all through one."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn,
        min_size=pool_size,
        max_size=pool_size,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    await pool.open(wait=True)
    try:
        one = AsyncPostgresSaver(pool)
        await one.setup()
        prefix = f"langgraph-{uuid.uuid4().hex[:8]}"
        writers = [
            SaverWriter(one if shared else AsyncPostgresSaver(pool), f"{prefix}-{n}", state, key)
            for n in range(concurrency)
        ]
        operations: list[Operation] = [writer.commit for writer in writers]
        label = SHARED_LABEL if shared else LABEL
        return await closed_loop(label, operations, warmup=warmup, duration=duration, meters=meters)
    finally:
        await pool.close()
