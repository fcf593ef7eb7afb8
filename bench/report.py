"""The printed result: Markdown tables, ratios within the run, and the targets' verdicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.loadgen import Sample
from bench.machine import Machine
from bench.pipeline_cpu import TOTAL_STEP, CpuTable

FLOOR, CEILING, ZTATE, LANGGRAPH = "floor", "ceiling", "ztate", "langgraph"
STRUCTURAL, LANGGRAPH_SHARED = "structural", "langgraph-shared"
KINDS = (FLOOR, CEILING, STRUCTURAL, ZTATE, LANGGRAPH, LANGGRAPH_SHARED)
TARGET_CONCURRENCY = 32
TARGET_CEILING_RATIO = 0.6
# issue 19's targets at c=32: (what ztate is divided by, the least ratio)
TARGETS = (
    (CEILING, "the mTLS echo ceiling (b)", TARGET_CEILING_RATIO),
    (STRUCTURAL, "the structural ceiling (e)", 0.8),
    (LANGGRAPH_SHARED, "LangGraph, one shared saver (f)", 2.0),
    (LANGGRAPH, "LangGraph, a saver per worker (d)", 0.5),
)
TARGET_SERVER_CPU_RATIO = 2.5  # ztate server CPU per commit / echo server CPU per RPC
PIPELINE_BUDGET_US = 50.0
BUDGET_PAYLOAD = "1 KB"
CPU_SUBJECTS = ("client", "server", "postgres")


@dataclass(frozen=True)
class Measured:
    """One closed-loop sample, tagged with what it measured."""

    kind: str
    sample: Sample


@dataclass(frozen=True)
class Report:
    machine: Machine
    setup: Sequence[str]
    measured: Sequence[Measured]
    pipeline: CpuTable
    memory: Sequence[str] = ()  # the service's memory at many active threads, if measured

    def rounds(self, kind: str, concurrency: int) -> list[Sample]:
        """Every sample of one measurement, in the order the rounds ran."""
        return [
            entry.sample
            for entry in self.measured
            if entry.kind == kind and entry.sample.concurrency == concurrency
        ]

    def best(self, kind: str, concurrency: int) -> Sample | None:
        """The round with the highest throughput: the least disturbed by other load."""
        return max(self.rounds(kind, concurrency), key=lambda s: s.rate, default=None)

    def rate(self, kind: str, concurrency: int) -> float | None:
        best = self.best(kind, concurrency)
        return None if best is None else best.rate

    def concurrencies(self) -> list[int]:
        return sorted({entry.sample.concurrency for entry in self.measured})


def render(report: Report) -> str:
    sections = [
        "\n".join(report.machine.lines() + list(report.setup)),
        _throughput_table(report),
        _ratio_table(report),
        _pipeline_table(report.pipeline),
        "\n".join(report.memory),
        "\n".join(_verdicts(report)),
    ]
    return "\n\n".join(section for section in sections if section)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def _number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _throughput_table(report: Report) -> str:
    header = ["measurement", "c", "ops/s", "p50 ms", "p99 ms"]
    header += [f"{subject} µs/op" for subject in CPU_SUBJECTS]
    header += ["cores busy", "others", "ops/s by round"]
    rows = []
    for concurrency in report.concurrencies():
        for kind in KINDS:
            best = report.best(kind, concurrency)
            if best is not None:
                every = " / ".join(_number(s.rate) for s in report.rounds(kind, concurrency))
                rows.append([*_sample_cells(best), every])
    return _table(header, rows)


def _sample_cells(sample: Sample) -> list[str]:
    return [
        sample.label,
        str(sample.concurrency),
        _number(sample.rate),
        _number(sample.latency_ms(0.50), 2),
        _number(sample.latency_ms(0.99), 2),
        *(_number(sample.cpu_per_op_us(subject)) for subject in CPU_SUBJECTS),
        _number(sample.cores_busy, 2),
        _number(sample.other_cores_busy, 2),
    ]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _ratio_table(report: Report) -> str:
    rows = []
    for concurrency in report.concurrencies():
        ztate = report.rate(ZTATE, concurrency)
        floor = report.rate(FLOOR, concurrency)
        rows.append(
            [
                str(concurrency),
                _number(_ratio(ztate, report.rate(CEILING, concurrency)), 2),
                _number(_ratio(ztate, report.rate(STRUCTURAL, concurrency)), 2),
                _number(_ratio(ztate, floor), 2),
                _number(_ratio(ztate, report.rate(LANGGRAPH, concurrency)), 2),
                _number(_ratio(ztate, report.rate(LANGGRAPH_SHARED, concurrency)), 2),
                _number(_ratio(report.rate(CEILING, concurrency), floor), 2),
                _number(_ratio(report.rate(STRUCTURAL, concurrency), floor), 2),
                _number(_server_cpu_ratio(report, concurrency), 2),
            ]
        )
    header = [
        "c",
        "ztate / echo (b)",
        "ztate / structural (e)",
        "ztate / floor (a)",
        "ztate / langgraph per worker (d)",
        "ztate / langgraph shared (f)",
        "echo / floor",
        "structural / floor",
        "server CPU ztate / echo",
    ]
    return _table(header, rows)


def _server_cpu_ratio(report: Report, concurrency: int) -> float | None:
    """ztate's server CPU per commit over the echo server's per RPC (each its best round)."""
    ztate, echo = report.best(ZTATE, concurrency), report.best(CEILING, concurrency)
    if ztate is None or echo is None:
        return None
    return _ratio(ztate.cpu_per_op_us("server"), echo.cpu_per_op_us("server"))


def _pipeline_table(table: CpuTable) -> str:
    names = [payload.name for payload in table.payloads]
    sizes = [
        f"{name} ({len(payload.patch_json):,} B)"
        for name, payload in zip(names, table.payloads, strict=True)
    ]
    rows = [
        [step, *(_number(by_payload.get(name), 1) for name in names)]
        for step, by_payload in table.rows.items()
    ]
    rendered = _table(["pipeline CPU per proposal, µs", *sizes], rows)
    if table.refusals:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in table.refusals.items())
        rendered += f"\nn/a: the default policy refuses the patch ({reasons})"
    return rendered


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _verdicts(report: Report) -> list[str]:
    lines = []
    ztate = report.rate(ZTATE, TARGET_CONCURRENCY)
    for kind, name, least in TARGETS:
        ratio = _ratio(ztate, report.rate(kind, TARGET_CONCURRENCY))
        if ratio is not None:
            lines.append(
                f"target: ztate >= {least} x {name} at c={TARGET_CONCURRENCY}: "
                f"{ratio:.2f} -> {_verdict(ratio >= least)}"
            )
    cpu_ratio = _server_cpu_ratio(report, TARGET_CONCURRENCY)
    if cpu_ratio is not None:
        lines.append(
            f"target: server CPU per commit <= {TARGET_SERVER_CPU_RATIO} x the echo server's per "
            f"RPC at c={TARGET_CONCURRENCY}: {cpu_ratio:.2f} -> "
            f"{_verdict(cpu_ratio <= TARGET_SERVER_CPU_RATIO)}"
        )
    ours = report.best(ZTATE, TARGET_CONCURRENCY)
    mine = ours.cpu_per_op_us("postgres") if ours is not None else None
    # the target's LangGraph: a saver per worker (d), its fastest; one shared saver (f),
    # its default wiring, is said beside it
    for kind, wiring in (
        (LANGGRAPH, "a saver per worker (d)"),
        (LANGGRAPH_SHARED, "one shared saver (f)"),
    ):
        langgraph = report.best(kind, TARGET_CONCURRENCY)
        theirs = langgraph.cpu_per_op_us("postgres") if langgraph is not None else None
        if mine is not None and theirs is not None:
            what = "target" if kind == LANGGRAPH else "beside it"
            lines.append(
                f"{what}: Postgres CPU per commit <= LangGraph's per write, {wiring}, at "
                f"c={TARGET_CONCURRENCY}: {mine:.0f} vs {theirs:.0f} µs -> "
                f"{_verdict(mine <= theirs)}"
            )
    total = report.pipeline.rows.get(TOTAL_STEP, {}).get(BUDGET_PAYLOAD)
    if total is not None:
        lines.append(
            f"budget: pipeline CPU <= {PIPELINE_BUDGET_US:.0f} µs for a {BUDGET_PAYLOAD} patch: "
            f"{total:.1f} µs -> {_verdict(total <= PIPELINE_BUDGET_US)}"
        )
    return lines
