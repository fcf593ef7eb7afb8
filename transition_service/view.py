"""Reading a view: the head, projected to the keys the caller may read."""

from __future__ import annotations

from ztate.contract.canonical import canonical_bytes
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.thread_ids import check_thread_id
from ztate.transition_service.checks import (
    check_privileged,
    check_registered,
    hide_foreign_thread,
    thread_not_found,
)
from ztate.transition_service.requests import (
    View,
)
from ztate.transition_service.usecase import UseCase


class ReadView(UseCase):
    """``GetView``: the caller's projection of the head."""

    async def view(self, caller: Identity, thread_id: str) -> View:
        check_thread_id(thread_id)
        readable: frozenset[str] | None = None
        policy = None
        if caller.role is Role.NODE:
            policy = check_registered(caller, self._policies)
            readable = policy.readable(caller.name)
        else:
            check_privileged(caller, "read views")
        head = await self._store.read_head(thread_id)
        if head is None:
            raise thread_not_found(thread_id)
        if policy is not None:
            hide_foreign_thread(caller, policy, head)
        state = self._remember(head)
        projected = state if readable is None else {k: state[k] for k in state.keys() & readable}
        return View(thread_id, head.version, head.digest, canonical_bytes(projected))
