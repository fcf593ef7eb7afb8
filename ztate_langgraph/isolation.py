"""Node isolation: each node of a LangGraph ``StateGraph`` a ztate worker of its own.

``isolate(builder, workers, target=..., operator=...)`` returns an ``IsolatedGraph``: the
same graph (its schema, edges and routing) whose nodes run in separate processes
(``python -m ztate.langgraph.worker``), one per node, each with its own certificate.
In the graph run, a node's step is: its worker reads its view of the ztate thread (the
projection its policy allows, not the graph's whole state), calls the node's function
with it, and proposes the returned update under its own identity. What the ledger
committed (the record's patch, read back by the operator) is what the graph run's
state receives, so LangGraph's channels follow the ztate thread's keys.

* A refused update (``KEY_NOT_WRITABLE``, a schema or an invariant violation, ...)
  stops the run with ``NodeUpdateRefused`` naming the node, the reason and the keys;
  nothing was committed and the service wrote a rejection row.
* An update that matches a risk rule is parked: ``on_parked`` is called with
  ``Parked`` (the handle a reviewer's decision is waited on) and the run blocks until
  it is decided, up to ``approval_wait`` seconds. Approved, it commits and the run
  continues; approved after the thread moved on (stale: nothing committed), the node
  runs again on the new head and proposes again (parked again if still risky), up to 5
  attempts; otherwise ``NodeUpdateNotApproved``.

LangGraph thread = ztate thread: ``config["configurable"]["thread_id"]`` is the ztate
thread id; channels = keys: every channel of the state schema must be a last-value
channel (a patch sets a key; reducers do not exist in ztate). The graph's ``input`` is
the thread's initial state, created by ``operator`` under ``policy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from langchain_core.runnables import RunnableConfig
from langgraph.channels.last_value import LastValue
from langgraph.graph import StateGraph

from ztate.worker_sdk import AlreadyExists, ZtateClient

WORKER_MODULE = "ztate.langgraph.worker"
# what a worker process inherits of this one's environment (never credentials)
INHERITED_ENV = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT")
START_TIMEOUT_SECONDS = 60.0  # from spawning a worker to its "ready"
# a worker's time to exit of itself once its input is closed, before it is killed
EXIT_GRACE_SECONDS = 5.0
MAX_LINE_BYTES = 16 * 1024 * 1024  # of a worker's message (a committed patch's keys, ...)


@dataclass(frozen=True, slots=True)
class NodeWorker:
    """The ztate identity a graph node runs under: ``identity`` is the node's name in the
    policy (``spiffe://<domain>/node/<identity>``), ``cert``/``key``/``ca`` its files.
    ``function`` is ``module:function``; by default, the graph node's own function
    (which must then be importable: a module-level function)."""

    identity: str
    cert: Path | str
    key: Path | str
    ca: Path | str
    function: str | None = None


@dataclass(frozen=True, slots=True)
class Parked:
    """An update a reviewer must approve before the run goes on."""

    node: str
    thread_id: str
    handle: str
    base_version: int
    digest: str
    risk_rules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NodeStep:
    """What one node step became: ``seen`` the keys its view held, ``status`` one of
    "committed", "noop" (it returned no update), "refused", "failed" or an
    approval's outcome ("rejected", "expired", "stale", "pending")."""

    node: str
    thread_id: str
    status: str
    seen: tuple[str, ...]
    version: int | None = None
    keys: tuple[str, ...] = ()
    reason: str | None = None


class IsolationError(Exception):
    """A node step of an isolated graph did not commit."""


class NodeUpdateRefused(IsolationError):
    """The control plane refused a node's update: nothing was committed, and the
    refusal is in the rejections ledger."""

    def __init__(self, node: str, reason: str, keys: tuple[str, ...], message: str) -> None:
        named = f" (keys: {', '.join(keys)})" if keys else ""
        super().__init__(f"node {node!r}: update refused, {reason}{named}: {message}")
        self.node = node
        self.reason = reason
        self.keys = keys


class NodeUpdateNotApproved(IsolationError):
    """A node's update was parked for approval and not committed (``status``: rejected,
    expired, refused, pending when ``approval_wait`` ran out, or stale when its last
    attempt was approved after the thread moved on: a stale one is re-run first)."""

    def __init__(self, node: str, status: str) -> None:
        super().__init__(f"node {node!r}: update parked for approval and not committed: {status}")
        self.node = node
        self.status = status


class NodeFailed(IsolationError):
    """A node's worker failed (its function raised, or it could not reach ztate)."""

    def __init__(self, node: str, reason: str, message: str) -> None:
        super().__init__(f"node {node!r} failed: {reason}: {message}")
        self.node = node
        self.reason = reason


OnParked = Callable[[Parked], Awaitable[None] | None]


def function_spec(function: Any) -> str:
    """``module:qualname`` of a module-level function (what a worker process imports)."""
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", "")
    if not module or not name or "<" in name:
        raise ValueError(
            f"{function!r} is not a module-level function: give NodeWorker(function=...)"
        )
    if module == "__main__":
        raise ValueError(
            f"{name} is defined in __main__, which a worker process cannot import: move it "
            "to a module or give NodeWorker(function='module:function')"
        )
    return f"{module}:{name}"


def _node_function(builder: StateGraph[Any], name: str) -> Any:
    runnable = builder.nodes[name].runnable
    for attribute in ("func", "afunc"):
        found = getattr(runnable, attribute, None)
        if found is not None:
            return found
    raise ValueError(f"node {name!r} is not a function: give NodeWorker(function=...)")


# what a worker's reply may say of its step: noop, or what the runner recorded
# (worker_sdk's Outcome); anything else is a broken protocol, never repeated
STATUSES = frozenset(
    {"noop", "committed", "refused", "failed", "rejected", "expired", "stale", "pending"}
)


def _malformed(message: dict[str, Any]) -> str | None:
    """What is wrong with a message of a worker (a "parked" event or a step's reply), in
    words that never repeat its content (it may hold state values); None when nothing."""

    def strings(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(item, str) for item in value)

    def version(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if message.get("event") == "parked":
        if not (
            isinstance(message.get("handle"), str)
            and version(message.get("base_version"))
            and isinstance(message.get("digest", ""), str)
            and strings(message.get("risk_rules", []))
        ):
            return "a parked message whose fields are not valid"
        return None
    if message.get("status") not in STATUSES:
        return "a reply without a known status"
    if message["status"] == "committed" and not version(message.get("version")):
        return "a committed reply without a valid version"
    if not strings(message.get("keys", [])):
        return "a reply whose keys are not a list of strings"
    if not isinstance(message.get("seen", []), list):
        return "a reply whose seen is not a list"
    for name in ("reason", "message"):
        if not isinstance(message.get(name, ""), str | None):
            return f"a reply whose {name} is not a string"
    return None


class _Worker:
    """One worker process and its protocol; one step at a time. A worker that breaks the
    protocol (or exits) is ended (killed, reaped, its pipes closed); the next step
    starts a fresh one."""

    def __init__(self, node: str, worker: NodeWorker, spec: str) -> None:
        self.node = node
        self.worker = worker
        self.spec = spec
        self.process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._steps = 0
        self._launch: tuple[str, str | None, Path, dict[str, str]] | None = None

    async def start(
        self, target: str, server_name: str | None, cwd: Path, extra: dict[str, str]
    ) -> None:
        self._launch = (target, server_name, cwd, extra)
        env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
        env |= extra
        env |= {
            "ZTATE_WORKER_TARGET": target,
            "ZTATE_WORKER_CERT": str(self.worker.cert),
            "ZTATE_WORKER_KEY": str(self.worker.key),
            "ZTATE_WORKER_CA": str(self.worker.ca),
        }
        if server_name:
            env["ZTATE_WORKER_SERVER_NAME"] = server_name
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            WORKER_MODULE,
            self.worker.identity,
            self.spec,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env,
            limit=MAX_LINE_BYTES,
        )
        try:
            ready = await asyncio.wait_for(self._read(), START_TIMEOUT_SECONDS)
        except TimeoutError:
            await self.end()
            raise NodeFailed(
                self.node, "WORKER_START", f"not ready within {START_TIMEOUT_SECONDS:g} s"
            ) from None
        if ready.get("event") != "ready":
            raise await self._broken("the worker's first message is not its ready event")

    async def end(self, grace: float = 0.0) -> int | None:
        """End the worker process: close its input, give it ``grace`` seconds to exit of
        itself, then kill it; it is reaped (no zombie) and its pipes are closed. Returns
        its exit status (negative: the signal that ended it), or None when we killed it.
        A step cancelled during the grace does not leave the worker running: it is killed
        and reaped, then the cancellation goes on."""
        process = self.process
        if process is None:
            return None
        if process.stdin is not None:
            process.stdin.close()
        try:
            if process.returncode is None and grace > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), grace)
        except BaseException:
            if process.returncode is None:
                process.kill()
            await process.wait()
            raise
        killed = process.returncode is None
        if killed:
            process.kill()
        code = await process.wait()
        # a worker that exited just before the kill keeps its own status
        return None if killed and code == -signal.SIGKILL else code

    async def _broken(self, what: str) -> NodeFailed:
        """The worker broke the protocol: it is ended, and ``what`` (never the line's
        content, which may hold state values) is the PROTOCOL failure to raise."""
        await self.end()
        return NodeFailed(self.node, "PROTOCOL", what)

    async def _gone(self, closed: str) -> NodeFailed:
        """The worker closed its ``closed`` pipe ("input" or "output"): it is given
        ``EXIT_GRACE_SECONDS`` to exit, and the failure says how it ended: its own exit
        status (WORKER_EXITED), or killed for not exiting (PROTOCOL)."""
        code = await self.end(EXIT_GRACE_SECONDS)
        if code is None:
            return NodeFailed(
                self.node,
                "PROTOCOL",
                f"the worker closed its {closed} and did not exit within "
                f"{EXIT_GRACE_SECONDS:g} s: it was killed",
            )
        ended = f"exited with code {code}" if code >= 0 else f"was ended by signal {-code}"
        return NodeFailed(
            self.node,
            "WORKER_EXITED",
            f"the worker process of {self.worker.identity!r} {ended} (its standard error says why)",
        )

    async def _read(self) -> dict[str, Any]:
        assert self.process is not None
        assert self.process.stdout is not None
        try:
            line = await self.process.stdout.readline()
        except ValueError:  # a line over the stream's limit
            raise await self._broken("the worker sent an oversized line") from None
        if not line:
            raise await self._gone("output")
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise await self._broken("the worker sent a line that is not a message")
        return message

    async def step(
        self, thread_id: str, approval_wait: float, on_parked: OnParked | None
    ) -> dict[str, Any]:
        async with self._lock:
            if self.process is None or self.process.returncode is not None:
                # the last one broke the protocol or exited: a fresh worker
                assert self._launch is not None, "start() the worker first"
                await self.start(*self._launch)
            assert self.process is not None
            assert self.process.stdin is not None
            # a step abandoned by a cancelled run may still answer: its replies carry
            # its own id, and are skipped
            self._steps += 1
            request = {"id": self._steps, "thread_id": thread_id, "approval_wait": approval_wait}
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                await self.process.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                raise await self._gone("input") from None
            while True:
                message = await self._read()
                if message.get("id") != self._steps:
                    continue
                wrong = _malformed(message)
                if wrong is not None:
                    raise await self._broken(f"the worker sent {wrong}")
                if message.get("event") == "parked":
                    if on_parked is not None:
                        parked = Parked(
                            self.node,
                            thread_id,
                            message["handle"],
                            message["base_version"],
                            message.get("digest", ""),
                            tuple(message.get("risk_rules", ())),
                        )
                        called = on_parked(parked)
                        if inspect.isawaitable(called):
                            await called
                    continue
                return message


@dataclass
class IsolatedGraph:
    """A graph whose nodes run as ztate workers; use it as an async context manager
    (the worker processes start on entry and stop on exit)."""

    builder: StateGraph[Any]
    workers: Mapping[str, NodeWorker]
    target: str
    operator: ZtateClient
    policy: str = ""
    server_name: str | None = None
    approval_wait: float = 300.0
    on_parked: OnParked | None = None
    cwd: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    compile_options: Mapping[str, Any] = field(default_factory=dict)
    steps: list[NodeStep] = field(default_factory=list)
    _processes: dict[str, _Worker] = field(default_factory=dict, init=False, repr=False)
    _graph: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        nodes = set(self.builder.nodes)
        if set(self.workers) != nodes:
            missing, unknown = nodes - set(self.workers), set(self.workers) - nodes
            raise ValueError(
                f"one NodeWorker per graph node: missing {sorted(missing)}, "
                f"unknown {sorted(unknown)}"
            )
        reducers = [
            name
            for name, channel in self.builder.channels.items()
            if not isinstance(channel, LastValue)
        ]
        if reducers:
            raise ValueError(
                f"channels {sorted(reducers)} have reducers: under ztate a channel is a key "
                "that a patch sets (last value), so reducers are not supported"
            )
        for name, worker in self.workers.items():
            spec = worker.function or function_spec(_node_function(self.builder, name))
            self._processes[name] = _Worker(name, worker, spec)
        self._graph = self._compile()

    def _compile(self) -> Any:
        proxies: StateGraph[Any] = StateGraph(self.builder.state_schema)
        for name in self.builder.nodes:
            proxies.add_node(name, self._proxy(name))
        isolated = copy.copy(self.builder)
        isolated.nodes = {
            name: dataclasses.replace(spec, runnable=proxies.nodes[name].runnable)
            for name, spec in self.builder.nodes.items()
        }
        return isolated.compile(**dict(self.compile_options))

    def _proxy(self, name: str) -> Callable[..., Awaitable[dict[str, Any]]]:
        async def run_in_worker(state: Any, config: RunnableConfig) -> dict[str, Any]:
            del state  # the worker reads its own projection from ztate
            return await self._step(name, _thread_of(config))

        run_in_worker.__name__ = f"ztate_{name}"
        return run_in_worker

    async def _step(self, name: str, thread_id: str) -> dict[str, Any]:
        reply = await self._processes[name].step(thread_id, self.approval_wait, self.on_parked)
        status = str(reply.get("status"))
        keys = tuple(str(k) for k in reply.get("keys", ()))
        reason = reply.get("reason")
        self.steps.append(
            NodeStep(
                name,
                thread_id,
                status,
                tuple(reply.get("seen", ())),
                reply.get("version"),
                keys,
                reason,
            )
        )
        if status == "noop":
            return {}
        if status == "committed":
            committed = await self.operator.get_transition(
                thread_id=thread_id, version=int(reply["version"])
            )
            identity = self.workers[name].identity
            if committed.node_id.rpartition("/node/")[2] != identity:
                raise NodeFailed(
                    name,
                    "PROTOCOL",
                    f"version {committed.version} of {thread_id} was not committed by {identity!r}",
                )
            patch: dict[str, Any] = committed.record["patch"]
            return patch
        if status == "refused" and reason:
            raise NodeUpdateRefused(name, str(reason), keys, str(reply.get("message", "")))
        if status == "failed":
            raise NodeFailed(name, str(reason), str(reply.get("message", "")))
        raise NodeUpdateNotApproved(name, status)

    async def __aenter__(self) -> IsolatedGraph:
        cwd = self.cwd or Path.cwd()
        try:
            await asyncio.gather(
                *(
                    worker.start(self.target, self.server_name, cwd, dict(self.env))
                    for worker in self._processes.values()
                )
            )
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every worker process (their input closes; killed after a grace period)."""
        await asyncio.gather(
            *(worker.end(EXIT_GRACE_SECONDS) for worker in self._processes.values())
        )

    @property
    def graph(self) -> Any:
        """The compiled graph whose nodes are the workers."""
        return self._graph

    def pids(self) -> dict[str, int]:
        """The worker process of each node."""
        return {
            name: worker.process.pid
            for name, worker in self._processes.items()
            if worker.process is not None
        }

    async def ainvoke(
        self, input: Mapping[str, Any] | None, config: RunnableConfig, **kwargs: Any
    ) -> dict[str, Any]:
        """Run the graph on ztate thread ``config["configurable"]["thread_id"]``:
        ``input`` is the initial state of a new thread (created by the operator); with
        ``None`` the thread exists and the run starts from its head."""
        thread_id = _thread_of(config)
        if input is not None:
            genesis = await self.operator.create_thread(thread_id, dict(input), policy=self.policy)
            if genesis.replayed:
                # the same operator created it with the same input before: running again
                # would run every node again on its head, as LangGraph started afresh
                raise AlreadyExists(
                    grpc.StatusCode.ALREADY_EXISTS,
                    "THREAD_EXISTS",
                    f"thread {thread_id!r} exists (created with this input before): pass "
                    "None as the input to run on from its head",
                )
            start: dict[str, Any] = dict(input)
        else:
            start = (await self.operator.get_view(thread_id)).state
        result: dict[str, Any] = await self._graph.ainvoke(start, config, **kwargs)
        return result


def _thread_of(config: RunnableConfig) -> str:
    thread_id = (config.get("configurable") or {}).get("thread_id")
    if not isinstance(thread_id, str) or not thread_id:
        raise ValueError('an isolated graph runs on config["configurable"]["thread_id"]')
    return thread_id


def isolate(
    builder: StateGraph[Any],
    workers: Mapping[str, NodeWorker],
    *,
    target: str,
    operator: ZtateClient,
    **options: Any,
) -> IsolatedGraph:
    """Run ``builder``'s nodes as ztate workers (see ``IsolatedGraph``): ``workers``
    names each graph node's identity and certificate."""
    return IsolatedGraph(builder, workers, target, operator, **options)


__all__ = [
    "IsolatedGraph",
    "IsolationError",
    "NodeFailed",
    "NodeStep",
    "NodeUpdateNotApproved",
    "NodeUpdateRefused",
    "NodeWorker",
    "Parked",
    "isolate",
]
