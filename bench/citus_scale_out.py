"""Commits/s on Citus: the coordinator alone, with one worker, and with two, in one run.

``python -m bench.citus_scale_out`` (as root or the postgres user, on a machine where
``../shared/citus/install.sh`` built Citus) starts a coordinator and two workers with
fsync and synchronous commit on (``tests/citus/cluster.py``, the citus lane's
cluster), and makes three databases on it: one migrated but not distributed (the
tables stay on the coordinator: plain Postgres plus Citus' planner hook), one
distributed over one worker, one over two (``ztate db citus``). On each it runs the
floor of ``bench/floor.py``: the transition store's one-statement commit straight
through asyncpg, as the service role, 32 writers on their own threads; on two workers
also through the store's group commit (several threads' commits in one statement). Rounds
alternate the layouts; the best round of each counts. CPU per commit is measured
for each node's whole process tree, so the coordinator's cost of routing shows.

All nodes share this machine's cores with the load generator: the figures compare
layouts within one run, they are not a cluster's capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import cpu
from bench.floor import commit_payload, measure_floor
from bench.loadgen import Sample
from bench.workload import receipt_patch
from tests.citus.cluster import CitusCluster, Node, citus_installed, ztate_database
from ztate.contract.keyring import Keyring, generate_keyring_file

ROLE = "ztate_transition"
# the store's group commit (several threads' commits in one statement) on two workers:
# multi-shard by nature, against the one-row commits of the other layouts
GROUPED = "coordinator + 2 workers, group commit"


async def measure(options: argparse.Namespace) -> list[str]:
    cluster = CitusCluster(durable=True, shard_count=options.shard_count)
    cluster.start()
    try:
        # the two-worker database first: its migrations create the service roles with
        # both workers in place, so Citus creates them there too (roles are the
        # server's, and a database whose migrations found them would not)
        two = await ztate_database(cluster)
        one = await ztate_database(cluster, cluster.worker_nodes[:1])
        alone = await ztate_database(cluster, [], distribute=False)
        layouts: dict[str, tuple[str, list[Node]]] = {
            "coordinator only, not distributed": (alone, [cluster.coordinator]),
            "coordinator + 1 worker": (one, cluster.nodes[:2]),
            "coordinator + 2 workers": (two, cluster.nodes),
            GROUPED: (two, cluster.nodes),
        }
        folder = Path(tempfile.mkdtemp(prefix="ztate-bench-citus-"))
        generate_keyring_file(folder / "keyring.json", "bench-k1")
        keyring = Keyring.load(folder / "keyring.json", None)
        payload = commit_payload(receipt_patch(options.patch_bytes), keyring, "ab" * 32)
        meters = {node.name: cpu.process_tree(node.pid) for node in cluster.nodes}
        best: dict[str, Sample] = {}
        for _ in range(options.rounds):
            for name, (dsn, _nodes) in layouts.items():
                sample = await measure_floor(
                    dsn,
                    payload,
                    role=ROLE,
                    pool_size=options.concurrency,
                    concurrency=options.concurrency,
                    warmup=options.warmup,
                    duration=options.duration,
                    meters=meters,
                    grouped=name == GROUPED,
                )
                print(f"  {name}: {sample.rate:,.0f} commits/s", flush=True)
                if name not in best or sample.rate > best[name].rate:
                    best[name] = sample
        return report(best, layouts)
    finally:
        cluster.stop()


def report(best: dict[str, Sample], layouts: dict[str, tuple[str, list[Node]]]) -> list[str]:
    base = best["coordinator only, not distributed"].rate
    lines = [
        "| layout | commits/s | vs not distributed | p50 ms | CPU µs per commit, by node |",
        "|---|--:|--:|--:|---|",
    ]
    for name, sample in best.items():
        per_node = ", ".join(
            f"{node.name} {sample.cpu_per_op_us(node.name) or 0:,.0f}" for node in layouts[name][1]
        )
        lines.append(
            f"| {name} | {sample.rate:,.0f} | {sample.rate / base:.2f} | "
            f"{sample.latency_ms(0.5):.2f} | {per_node} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.citus_scale_out", description=__doc__)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured (5)")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds discarded (1.5)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the best counts (2)")
    parser.add_argument("--concurrency", type=int, default=32, help="writers (32)")
    parser.add_argument("--patch-bytes", type=int, default=1024, help="patch size (1024)")
    parser.add_argument("--shard-count", type=int, default=32, help="citus.shard_count (32)")
    options = parser.parse_args(argv)
    missing = citus_installed()
    if missing:
        print(f"needs Citus: {missing}")
        return 2
    print("\n".join(asyncio.run(measure(options))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
