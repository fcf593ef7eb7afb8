"""A closed-loop load generator: N workers, each issuing one operation at a time.

Every worker waits for its previous operation before it starts the next, as an
agent worker proposing against the version it last committed does. The run has a
warm-up (connections, TLS handshakes, caches) that is discarded, then a fixed
measurement window: an operation counts when it completes inside the window.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter

from bench.cpu import CpuMeter, whole_machine

MACHINE = "machine"
Operation = Callable[[], Awaitable[object]]
"""One worker's next operation; it keeps its own state (thread, version) between calls."""


@dataclass(frozen=True)
class Window:
    """The measured interval, on the ``perf_counter`` clock."""

    start: float
    end: float


@dataclass(frozen=True)
class Sample:
    """What one closed-loop measurement observed."""

    label: str
    concurrency: int
    seconds: float
    latencies: Sequence[float]
    """Latency in seconds of every operation completed in the window, sorted."""
    cpu_seconds: Mapping[str, float]
    """CPU used during the window, by subject (client, server, postgres)."""
    machine_seconds: float
    """CPU used during the window by every process on the machine."""

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        """Operations completed per second."""
        return self.completed / self.seconds

    def latency_ms(self, quantile: float) -> float:
        """Nearest-rank latency quantile, in milliseconds."""
        if not self.latencies:
            return math.nan
        rank = max(1, math.ceil(quantile * len(self.latencies)))
        return self.latencies[rank - 1] * 1000

    def cpu_per_op_us(self, subject: str) -> float | None:
        """CPU microseconds per completed operation, or None when not measured."""
        if subject not in self.cpu_seconds or not self.completed:
            return None
        return self.cpu_seconds[subject] / self.completed * 1e6

    @property
    def cores_busy(self) -> float:
        """CPU used by the measured subjects, in cores (the machine has ``nproc``)."""
        return sum(self.cpu_seconds.values()) / self.seconds

    @property
    def other_cores_busy(self) -> float:
        """CPU used by everything else on the machine, in cores: the disturbance."""
        return max(0.0, self.machine_seconds / self.seconds - self.cores_busy)


async def closed_loop(
    label: str,
    operations: Sequence[Operation],
    *,
    warmup: float,
    duration: float,
    meters: Mapping[str, CpuMeter],
) -> Sample:
    """Run one operation stream per worker; measure the window after ``warmup``."""
    began = perf_counter()
    window = Window(began + warmup, began + warmup + duration)
    latencies: list[float] = []
    cpu: dict[str, float] = {}
    all_meters = {**meters, MACHINE: whole_machine}
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(_meter(window, all_meters, cpu))
            for operation in operations:
                group.create_task(_drive(operation, window, latencies))
    except ExceptionGroup as failures:
        # one worker's failure stops the measurement; it is the one worth reading
        raise failures.exceptions[0] from None
    machine = cpu.pop(MACHINE)
    return Sample(label, len(operations), duration, sorted(latencies), cpu, machine)


async def _drive(operation: Operation, window: Window, latencies: list[float]) -> None:
    while True:
        began = perf_counter()
        if began >= window.end:
            return
        await operation()
        done = perf_counter()
        if window.start <= done < window.end:
            latencies.append(done - began)


async def _meter(window: Window, meters: Mapping[str, CpuMeter], into: dict[str, float]) -> None:
    await asyncio.sleep(max(0.0, window.start - perf_counter()))
    before = {subject: meter() for subject, meter in meters.items()}
    await asyncio.sleep(max(0.0, window.end - perf_counter()))
    for subject, meter in meters.items():
        into[subject] = meter() - before[subject]
