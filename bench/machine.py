"""What the figures were measured on: cores, CPU model, memory and library versions."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("grpcio", "protobuf", "asyncpg", "uvloop", "rfc8785", "orjson", "cryptography")


@dataclass(frozen=True)
class Machine:
    cores: int
    cpu_model: str
    memory_gib: float
    load_average: tuple[float, float, float]
    python: str
    libraries: dict[str, str]
    revision: str

    def lines(self) -> list[str]:
        one, five, fifteen = self.load_average
        versions = ", ".join(f"{name} {version}" for name, version in self.libraries.items())
        return [
            f"machine   {self.cores} cores ({self.cpu_model}), {self.memory_gib:.1f} GiB, "
            f"load average {one:.2f} {five:.2f} {fifteen:.2f} at start",
            f"software  ztate {self.revision}; Python {self.python}, {versions}",
        ]


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown CPU"


def _memory_gib() -> float:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 1024**2
    return 0.0


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return done.stdout.strip()


def revision() -> str:
    """The commit measured, and whether tracked files differed from it."""
    commit = _git("rev-parse", "--short", "HEAD")
    if not commit:
        return "(not a git checkout)"
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return f"{commit} with uncommitted changes" if changed else commit


def describe() -> Machine:
    return Machine(
        cores=len(os.sched_getaffinity(0)),
        cpu_model=_cpu_model(),
        memory_gib=_memory_gib(),
        load_average=os.getloadavg(),
        python=platform.python_version(),
        libraries={name: _version(name) for name in LIBRARIES},
        revision=revision(),
    )
