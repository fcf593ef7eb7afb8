"""LangGraph under ztate (docs/langgraph.md): a checkpoint saver whose every checkpoint is a
signed, chained ledger transition, and node isolation, each node of a ``StateGraph`` a
ztate worker in a process of its own with its own certificate.

Installed as ``ztate.langgraph`` with ``pip install 'ztate-worker[langgraph]'``: a worker-side
adapter, with no server code.
"""

from ztate.langgraph.checkpointer import (
    CHECKPOINTER_NODE,
    CheckpointNotVerified,
    ZtateCheckpointSaver,
    checkpoint_policy,
    ledger_thread_id,
)
from ztate.langgraph.isolation import (
    IsolatedGraph,
    IsolationError,
    NodeFailed,
    NodeStep,
    NodeUpdateNotApproved,
    NodeUpdateRefused,
    NodeWorker,
    Parked,
    isolate,
)

__all__ = [
    "CHECKPOINTER_NODE",
    "CheckpointNotVerified",
    "IsolatedGraph",
    "IsolationError",
    "NodeFailed",
    "NodeStep",
    "NodeUpdateNotApproved",
    "NodeUpdateRefused",
    "NodeWorker",
    "Parked",
    "ZtateCheckpointSaver",
    "checkpoint_policy",
    "isolate",
    "ledger_thread_id",
]
