"""``isolate`` refuses, before starting any process, what cannot run isolated: a graph
node without its identity, a channel with a reducer (a ztate key is set by a patch),
a node function a worker process cannot import."""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from ztate.langgraph import NodeFailed, NodeWorker, isolate
from ztate.langgraph.isolation import function_spec
from ztate.langgraph.worker import load_function


class State(TypedDict, total=False):
    count: int


class Summed(TypedDict, total=False):
    items: Annotated[list[int], operator.add]


def bump(state: State) -> dict[str, Any]:
    return {"count": state.get("count", 0) + 1}


def worker(name: str) -> NodeWorker:
    return NodeWorker(name, "node.crt", "node.key", "ca.crt")


def graph_of(schema: Any, function: Any) -> StateGraph[Any]:
    builder: StateGraph[Any] = StateGraph(schema)
    builder.add_node("bump", function)
    builder.add_edge(START, "bump")
    builder.add_edge("bump", END)
    return builder


def isolated(builder: StateGraph[Any], workers: dict[str, NodeWorker]) -> object:
    # construction compiles the graph and starts nothing: no client is used yet
    return isolate(builder, workers, target="localhost:1", operator=None)  # type: ignore[arg-type]


def test_every_graph_node_needs_its_identity() -> None:
    with pytest.raises(ValueError, match=r"missing \['bump'\], unknown \['other'\]"):
        isolated(graph_of(State, bump), {"other": worker("other")})


def test_a_channel_with_a_reducer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"channels \['items'\] have reducers"):
        isolated(graph_of(Summed, bump), {"bump": worker("bump")})


def test_a_function_a_worker_cannot_import_is_refused() -> None:
    def local(state: State) -> dict[str, Any]:
        return {}

    with pytest.raises(ValueError, match="not a module-level function"):
        isolated(graph_of(State, local), {"bump": worker("bump")})
    # named explicitly, it is accepted
    graph = isolated(
        graph_of(State, local),
        {"bump": NodeWorker("bump", "c", "k", "a", function=f"{__name__}:bump")},
    )
    assert graph is not None


def test_a_module_level_function_is_found_again_by_its_spec() -> None:
    spec = function_spec(bump)
    assert spec == f"{__name__}:bump"
    assert load_function(spec) is bump
    with pytest.raises(ValueError, match="module:function"):
        load_function("no-colon")


async def test_a_worker_that_cannot_start_fails_the_entry_naming_its_node() -> None:
    spec = f"{__name__}_absent:bump"  # no such module: the worker process exits at once
    graph = isolate(
        graph_of(State, bump),
        {"bump": NodeWorker("bump", "node.crt", "node.key", "ca.crt", function=spec)},
        target="localhost:1",
        operator=None,  # type: ignore[arg-type]
    )
    with pytest.raises(NodeFailed) as failed:
        async with graph:
            pass
    assert (failed.value.node, failed.value.reason) == ("bump", "WORKER_EXITED")
    assert "exited with code 1" in str(failed.value)
    assert graph.pids()["bump"] > 0
