"""The parent side of the isolation protocol against a worker process that breaks it
(tests/unit/langgraph_bad_worker.py, a real child process): a malformed line fails the
step with NodeFailed("PROTOCOL") naming what was wrong and never the line's content (it
may hold state values); the worker is killed and reaped (no zombie) and its pipes are
closed in this process; the next step starts a fresh worker. A worker that exits, or
closes a pipe and keeps running, never hangs the step: its own exit code is reported,
or that it was killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from tests.unit import langgraph_bad_worker as double
from ztate.langgraph import IsolatedGraph, NodeFailed, NodeWorker, isolate, isolation

REPO = Path(__file__).resolve().parents[2]


class State(TypedDict, total=False):
    count: int


def bump(state: State) -> dict[str, Any]:
    return {"count": state.get("count", 0) + 1}


def graph(env: dict[str, str] | None = None) -> IsolatedGraph:
    builder: StateGraph[Any] = StateGraph(State)
    builder.add_node("bump", bump)
    builder.add_edge(START, "bump")
    builder.add_edge("bump", END)
    return isolate(
        builder,
        {"bump": NodeWorker("bump", "node.crt", "node.key", "ca.crt")},
        target="localhost:1",
        operator=None,  # type: ignore[arg-type]  # no committed step: never used
        cwd=REPO,
        env=env or {},
    )


@pytest.fixture(autouse=True)
def the_double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "WORKER_MODULE", double.__name__)


def pipes_of(pid: int) -> set[str]:
    """The pipes the worker's standard input and output are (``pipe:[inode]``)."""
    return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1)}


def open_in_this_process() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return found


def reaped(pid: int) -> bool:
    """True when ``pid`` is no child of ours any more (not running, not a zombie)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def run(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


async def until(condition: Any, within: float = 30.0) -> None:
    """Wait for ``condition()`` to hold (re-checked, bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, "condition did not hold in time"
        await asyncio.sleep(0.01)


async def fails(isolated: IsolatedGraph, thread_id: str) -> NodeFailed:
    """The step's failure; bounded, so that a step that hangs fails the test."""
    with pytest.raises(NodeFailed) as failed:
        await asyncio.wait_for(isolated.graph.ainvoke({"count": 1}, run(thread_id)), 30)
    assert double.SECRET not in str(failed.value)
    return failed.value


async def starts_afresh(isolated: IsolatedGraph, ended: int, steps: list[str]) -> None:
    """The worker ``ended`` is reaped, its pipes closed here; the next step has a fresh
    worker, which answers."""
    assert reaped(ended)
    assert await isolated.graph.ainvoke({"count": 1}, run("good-9")) == {"count": 1}
    assert isolated.pids()["bump"] != ended
    assert [s.status for s in isolated.steps] == [*steps, "noop"]


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("json", "a line that is not a message"),
        ("array", "a line that is not a message"),
        (
            "parked",
            "a parked message whose fields are not valid",
        ),
        ("version", "a committed reply without a valid version"),
        ("keys", "a reply whose keys are not a list of strings"),
        ("status", "a reply without a known status"),
        ("missing", "a reply without a known status"),
        ("rules", "a parked message whose fields are not valid"),
        ("digest", "a parked message whose fields are not valid"),
        ("seen", "a reply whose seen is not a list"),
        ("reason", "a reply whose reason is not a string"),
        ("message", "a reply whose message is not a string"),
        ("oversized", "an oversized line"),
    ],
)
async def test_a_malformed_line_fails_the_step_ends_the_worker_and_the_next_step_starts_afresh(
    kind: str, what: str
) -> None:
    async with graph() as isolated:
        first = isolated.pids()["bump"]
        pipes = pipes_of(first)
        assert all(p.startswith("pipe:") for p in pipes)
        with pytest.raises(NodeFailed) as failed:
            await isolated.graph.ainvoke({"count": 1}, run(f"bad-{kind}-1"))
        assert (failed.value.node, failed.value.reason) == ("bump", "PROTOCOL")
        assert str(failed.value) == f"node 'bump' failed: PROTOCOL: the worker sent {what}"
        assert double.SECRET not in str(failed.value)
        assert reaped(first), "the worker that broke the protocol is killed and reaped"
        assert not pipes & open_in_this_process(), "its pipes are closed here"
        # the next step: a fresh worker, which answers
        assert await isolated.graph.ainvoke({"count": 1}, run("good-1")) == {"count": 1}
        assert isolated.pids()["bump"] != first
        assert [s.status for s in isolated.steps] == ["noop"]
    assert reaped(isolated.pids()["bump"])


async def test_a_first_message_not_ready_is_not_repeated_and_the_worker_is_reaped() -> None:
    isolated = graph({"ZTATE_DOUBLE_MODE": "bad-ready"})
    with pytest.raises(NodeFailed) as failed:
        async with isolated:
            pass
    assert (failed.value.node, failed.value.reason) == ("bump", "PROTOCOL")
    assert str(failed.value) == (
        "node 'bump' failed: PROTOCOL: the worker's first message is not its ready event"
    )
    assert double.SECRET not in str(failed.value)
    assert reaped(isolated.pids()["bump"])


async def test_a_line_at_the_limit_is_read() -> None:
    async with graph() as isolated:
        assert await isolated.graph.ainvoke({"count": 1}, run("bad-longest-1")) == {"count": 1}
        assert [s.status for s in isolated.steps] == ["noop"]


async def test_a_worker_that_exits_mid_step_fails_it_with_its_own_exit_code() -> None:
    async with graph() as isolated:
        first = isolated.pids()["bump"]
        failed = await fails(isolated, "exit-1")
        assert (failed.node, failed.reason) == ("bump", "WORKER_EXITED")
        assert str(failed) == (
            "node 'bump' failed: WORKER_EXITED: the worker process of 'bump' exited with "
            "code 3 (its standard error says why)"
        )
        await starts_afresh(isolated, first, [])


@pytest.mark.parametrize(("pipe", "first_step"), [("output", []), ("input", ["noop"])])
async def test_a_worker_that_closes_a_pipe_and_keeps_running_is_killed_never_waited_for(
    monkeypatch: pytest.MonkeyPatch, pipe: str, first_step: list[str]
) -> None:
    monkeypatch.setattr(isolation, "EXIT_GRACE_SECONDS", 0.5)
    async with graph() as isolated:
        first = isolated.pids()["bump"]
        if pipe == "input":  # it answers this step, then the next one cannot be sent
            assert await isolated.graph.ainvoke({"count": 1}, run("close-input-1")) == {"count": 1}
            failed = await fails(isolated, "good-2")
        else:  # it answers nothing
            failed = await fails(isolated, "close-output-1")
        assert (failed.node, failed.reason) == ("bump", "PROTOCOL")
        assert str(failed) == (
            f"node 'bump' failed: PROTOCOL: the worker closed its {pipe} and did not exit "
            "within 0.5 s: it was killed"
        )
        await starts_afresh(isolated, first, first_step)


async def test_a_worker_that_closed_its_input_and_then_exits_is_reported_with_its_own_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(isolation, "EXIT_GRACE_SECONDS", 60.0)
    async with graph() as isolated:
        first = isolated.pids()["bump"]
        stdin = os.readlink(f"/proc/{first}/fd/0")
        assert await isolated.graph.ainvoke({"count": 1}, run("close-input-1")) == {"count": 1}
        step = asyncio.ensure_future(isolated.graph.ainvoke({"count": 1}, run("good-2")))
        # the request could not be written (the pipe is closed here): the worker, still
        # running, now exits of itself, within the grace period
        await until(lambda: step.done() or stdin not in open_in_this_process())
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGUSR1)
        with pytest.raises(NodeFailed) as failed:
            await asyncio.wait_for(step, 30)
        assert (failed.value.node, failed.value.reason) == ("bump", "WORKER_EXITED")
        assert str(failed.value) == (
            "node 'bump' failed: WORKER_EXITED: the worker process of 'bump' exited with "
            "code 3 (its standard error says why)"
        )
        await starts_afresh(isolated, first, ["noop"])


async def test_a_step_cancelled_while_its_worker_is_given_time_to_exit_kills_and_reaps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker closed its output and ignores the end of its input; the step, giving
    it time to exit, is cancelled: the worker is killed and reaped before the
    cancellation goes on, never left running."""
    monkeypatch.setattr(isolation, "EXIT_GRACE_SECONDS", 600.0)
    async with graph() as isolated:
        first = isolated.pids()["bump"]
        stdin = os.readlink(f"/proc/{first}/fd/0")
        step = asyncio.ensure_future(isolated.graph.ainvoke({"count": 1}, run("close-output-1")))
        # its output closed, the step ends the worker: its input is closed here, and the
        # step waits for the worker to exit
        await until(lambda: step.done() or stdin not in open_in_this_process())
        assert not step.done()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(step, 30)
        gone = reaped(first)
        if not gone:  # still our child, so the pid is not another's: end it for the test
            os.kill(first, signal.SIGKILL)
        assert gone
        assert not os.path.exists(f"/proc/{first}")  # noqa: ASYNC240 (procfs, instant)
        await starts_afresh(isolated, first, [])
