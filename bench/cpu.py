"""CPU time consumed by processes, read from ``/proc`` (Linux).

A throughput figure says how fast; CPU per operation says where the time went.
Each meter returns the CPU seconds (user + system, all threads) its subject has
used so far; a measurement takes the difference across its window.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

CpuMeter = Callable[[], float]
"""CPU seconds used so far by one subject."""

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Indexes into the fields of /proc/<pid>/stat after the ")" that closes the command
# name: field N of proc(5) is at N - 3.
_PPID, _UTIME, _STIME, _CUTIME, _CSTIME = 1, 11, 12, 13, 14


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _own_seconds(fields: list[str]) -> float:
    return (int(fields[_UTIME]) + int(fields[_STIME])) / _CLOCK_TICKS


def _reaped_children_seconds(fields: list[str]) -> float:
    return (int(fields[_CUTIME]) + int(fields[_CSTIME])) / _CLOCK_TICKS


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[_PPID]) == pid:
                found.append(int(entry.name))
    return found


def whole_machine() -> float:
    """CPU seconds all processes on this machine have used so far (steal excluded).

    Less what the measured subjects used, it is the load others put on the machine
    during a measurement: the figure that says whether a run was disturbed.
    """
    fields = Path("/proc/stat").read_text(encoding="ascii").split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
    return (user + nice + system + irq + softirq) / _CLOCK_TICKS


def this_process() -> CpuMeter:
    """The calling process: the load generator, with its gRPC and asyncpg threads."""
    return time.process_time


def process(pid: int) -> CpuMeter:
    """One process (all its threads), such as a server the benchmark started."""

    def seconds() -> float:
        fields = _stat_fields(pid)
        return _own_seconds(fields) if fields is not None else 0.0

    return seconds


def process_tree(pid: int) -> CpuMeter:
    """A parent and its direct children, such as a postmaster and its backends.

    Children that have exited and been reaped count through the parent's
    ``cutime``/``cstime``.
    """

    def seconds() -> float:
        fields = _stat_fields(pid)
        if fields is None:
            return 0.0
        total = _own_seconds(fields) + _reaped_children_seconds(fields)
        for child in _children(pid):
            child_fields = _stat_fields(child)
            if child_fields is not None:
                total += _own_seconds(child_fields)
        return total

    return seconds


def children_settled(pid: int, count: int, deadline: float = 5.0) -> None:
    """Wait (up to ``deadline`` seconds) until ``pid`` has at most ``count`` children:
    a postmaster whose backends of a closed connection have exited and been reaped,
    so that their CPU is in its ``cutime``/``cstime`` before a window closes."""
    until = time.monotonic() + deadline
    while len(_children(pid)) > count and time.monotonic() < until:
        time.sleep(0.01)


def children_count(pid: int) -> int:
    """How many children ``pid`` has now."""
    return len(_children(pid))
