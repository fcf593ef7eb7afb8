"""The transition service's use cases, behind one object: creating a thread, reading a
view, proposing a transition (every check a proposal passes, top to bottom: see
``ztate.transition_service.propose``) and reverting. Each use case is a module of its
own; this facade builds them on one shared state. It knows nothing of gRPC;
``ztate.transition_service.server`` adapts it.
"""

from __future__ import annotations

import asyncio

from ztate.contract.keyring import Keyring
from ztate.services.policy.model import PolicySet
from ztate.services.runtime.telemetry import NO_METRICS, Metrics
from ztate.services.store.interface import TransitionStore
from ztate.transition_service.create_thread import CreateThread
from ztate.transition_service.heads import HeadCache
from ztate.transition_service.propose import Propose
from ztate.transition_service.revert import RevertThread
from ztate.transition_service.usecase import Shared
from ztate.transition_service.view import ReadView


class TransitionPipeline:
    """Decides, records and signs transitions."""

    def __init__(
        self,
        *,
        store: TransitionStore,
        policies: PolicySet,
        keyring: Keyring,
        max_patch_bytes: int,
        max_depth: int,
        head_cache_size: int,
        max_state_bytes: int = 1024 * 1024,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self._heads = HeadCache(head_cache_size)
        # set whenever a proposal is parked, so the approval outbox wakes up
        self._parked = asyncio.Event()
        shared = Shared(
            store=store,
            policies=policies,
            keyring=keyring,
            max_patch_bytes=max_patch_bytes,
            max_depth=max_depth,
            max_state_bytes=max_state_bytes,
            heads=self._heads,
            parked=self._parked,
            metrics=metrics,
        )
        self.create_thread = CreateThread(shared).create_thread
        self.view = ReadView(shared).view
        proposing = Propose(shared)
        self.propose = proposing.propose
        self.refused = proposing.refused
        self.revert = RevertThread(shared).revert

    @property
    def parked(self) -> asyncio.Event:
        return self._parked

    @property
    def heads(self) -> HeadCache:
        return self._heads
