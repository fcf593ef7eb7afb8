"""Profile ``ztate serve`` under the end-to-end load: ``python -m bench.profile``.

Starts what the end-to-end measurement (c) starts (an embedded Postgres, a throw-away
PKI and keyring, a fresh migrated database, ``ztate serve`` as a child process), drives
it with ``--concurrency`` closed-loop proposers of the bench's 1 KB patch, and records
the server with py-spy (in the ``bench`` extra, which ``make bench`` installs) for
``--seconds``: ``--nonblocking`` by default (Python frames only: native time shows as
the Python frame that called into it), ``--native`` to pause the server at each
sample and see native frames too. Writes the raw collapsed stacks to ``--out`` and prints
the share of samples under the functions that matter most, so a change to the commit
path can be judged by where the server's time goes (docs/performance.md, "The
profile"). Not part of ``make bench``: py-spy needs ptrace rights.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import uvloop

from bench.end_to_end import health_check, measure_ztate, ztate_service
from bench.environment import (
    bench_database,
    make_keyring,
    make_pki,
    postgres_server,
    temporary_folder,
    wait_until_serving,
)
from bench.workload import receipt_patch
from ztate.worker_sdk import encode_json

DB_ROLE = "ztate_transition"


def _function(frame: str) -> str:
    """``name (file:line)`` without its line: one entry a function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def shares(collapsed: Path, top: int) -> list[str]:
    """The ``top`` functions by inclusive share of samples (counted once a stack), then
    by self share (the innermost Python frame: with --nonblocking, native time such as
    gRPC's core, uvloop or asyncpg's protocol shows as the frame that called into it)."""
    inclusive: Counter[str] = Counter()
    innermost: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_function(frame) for frame in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += count
        innermost[frames[-1]] += count
    lines = [f"{total} samples; inclusive:"]
    for frame, count in inclusive.most_common(top):
        lines.append(f"{100 * count / max(total, 1):5.1f}%  {frame[:150]}")
    lines.append("self (innermost Python frame):")
    for frame, count in innermost.most_common(top):
        lines.append(f"{100 * count / max(total, 1):5.1f}%  {frame[:150]}")
    return lines


async def profile(
    concurrency: int, seconds: float, out: Path, top: int, *, native: bool = False
) -> list[str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    async with AsyncExitStack() as stack:
        root = stack.enter_context(temporary_folder())
        keyring_file = make_keyring(root)
        server_dsn, postmaster_pid = stack.enter_context(postgres_server(root))
        database = await stack.enter_async_context(
            bench_database(server_dsn, postmaster_pid, DB_ROLE)
        )
        pki = make_pki(root / "pki")
        service = stack.enter_context(
            ztate_service(
                dsn=database.dsn,
                home=root / "home",
                pki=pki,
                keyring_file=keyring_file,
                log=root / "ztate-serve.log",
            )
        )
        await wait_until_serving(service, lambda: health_check(service.target, pki.operator))
        patch_json = encode_json(receipt_patch(1024))
        recorder = await asyncio.create_subprocess_exec(
            spy,
            "record",
            *(["--native"] if native else ["--nonblocking"]),
            "-r",
            "250",
            "-f",
            "raw",
            "-d",
            str(int(seconds)),
            "-o",
            str(out),
            "-p",
            str(service.process.pid),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        sample = await measure_ztate(
            service,
            pki,
            patch_json,
            concurrency=concurrency,
            warmup=0.5,
            duration=seconds + 1.0,
            meters={},
        )
        _, errors = await recorder.communicate()
        if recorder.returncode != 0 or not await asyncio.to_thread(out.exists):
            raise SystemExit(f"py-spy failed: {errors.decode(errors='replace').strip()}")
    return [f"{sample.rate:,.0f} commits/s at c={concurrency}", *shares(out, top)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("ztate-serve.profile.txt"))
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument(
        "--native",
        action="store_true",
        help="native frames too (py-spy then pauses the server at each sample: slower)",
    )
    options = parser.parse_args(argv)
    lines = uvloop.run(
        profile(
            options.concurrency, options.seconds, options.out, options.top, native=options.native
        )
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
