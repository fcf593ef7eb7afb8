"""LangGraph under ztate: a checkpoint saver whose every checkpoint is a signed, chained
ledger transition (docs/langgraph.md).

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

__all__ = [
    "CHECKPOINTER_NODE",
    "CheckpointNotVerified",
    "ZtateCheckpointSaver",
    "checkpoint_policy",
    "ledger_thread_id",
]
