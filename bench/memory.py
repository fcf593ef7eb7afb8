"""(e) The transition service's memory at 10,000 active threads.

``ztate serve`` keeps no per-thread state but its bounded head cache (``head
cache`` in the setup lines): everything else lives in Postgres. This measures
what that costs: the resident set (``VmRSS``) of the running service before,
after an operator created ``THREADS`` threads and after a worker committed one
proposal on each (every one of them active, their heads in the cache up to its
bound), read from ``/proc`` once the service is idle.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bench.end_to_end import sdk_client
from bench.environment import ChildServer, Pki
from bench.workload import INITIAL_STATE

THREADS = 10_000
CONCURRENCY = 32  # clients creating and proposing at once


@dataclass(frozen=True)
class MemoryFigures:
    threads: int
    head_cache: int
    idle_kib: int  # after the throughput rounds, before the threads
    created_kib: int  # after creating them
    active_kib: int  # after one commit on each
    peak_kib: int  # VmHWM: the highest resident set the process ever had

    def lines(self) -> list[str]:
        grown = self.active_kib - self.idle_kib
        return [
            f"memory of ztate serve at {self.threads:,} active threads (head cache "
            f"{self.head_cache:,}; resident set from /proc, service idle)",
            "",
            "| point | RSS MiB |",
            "|---|--:|",
            f"| before the threads (after the throughput rounds) | {self.idle_kib / 1024:,.1f} |",
            f"| {self.threads:,} threads created | {self.created_kib / 1024:,.1f} |",
            f"| one commit on each | {self.active_kib / 1024:,.1f} |",
            f"| peak (VmHWM) | {self.peak_kib / 1024:,.1f} |",
            "",
            f"growth: {grown / 1024:,.1f} MiB, {grown * 1024 / self.threads:,.0f} B per active "
            "thread",
        ]


def resident_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


async def _in_parallel(thread_ids: list[str], action: Callable[[str], Awaitable[None]]) -> None:
    """``action`` on every thread, ``CONCURRENCY`` at a time."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for thread_id in thread_ids:
        queue.put_nowait(thread_id)

    async def drain() -> None:
        while not queue.empty():
            await action(queue.get_nowait())

    await asyncio.gather(*(drain() for _ in range(CONCURRENCY)))


async def measure_memory(service: ChildServer, pki: Pki, head_cache: int) -> MemoryFigures:
    pid = service.process.pid
    idle, _ = resident_kib(pid)
    prefix = f"mem-{uuid.uuid4().hex[:8]}"
    thread_ids = [f"{prefix}-{n}" for n in range(THREADS)]
    async with sdk_client(service.target, pki.operator) as operator:

        async def create(thread_id: str) -> None:
            await operator.create_thread(thread_id, INITIAL_STATE)

        await _in_parallel(thread_ids, create)
    created, _ = resident_kib(pid)
    async with sdk_client(service.target, pki.worker) as worker:

        async def propose(thread_id: str) -> None:
            await worker.propose(thread_id, 0, {"approval_receipt": f"receipt-{thread_id}"})

        await _in_parallel(thread_ids, propose)
    active, peak = resident_kib(pid)
    return MemoryFigures(THREADS, head_cache, idle, created, active, peak)
