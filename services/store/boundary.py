"""The stores' boundary: no driver exception leaves a store.

A database that cannot be reached (refused, reset, restarted, out of connections,
a pooled connection lost while idle) leaves as ``StorageUnavailable``, the domain
error every caller already answers with UNAVAILABLE; anything else is a bug and
propagates unchanged. Each store method that touches the database wears
``@translated``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from ztate.services.runtime import errors
from ztate.services.runtime.outage import is_outage

P = ParamSpec("P")
R = TypeVar("R")
Store = TypeVar("Store")


def translated(
    method: Callable[Concatenate[Store, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Store, P], Coroutine[Any, Any, R]]:
    """The store's boundary: a database that cannot be reached leaves as
    ``StorageUnavailable``, never as a driver exception (the contract's rule)."""

    @functools.wraps(method)
    async def guarded(self: Store, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(self, *args, **kwargs)
        except Exception as failure:
            if is_outage(failure):
                raise errors.StorageUnavailable(
                    "the ledger database is unavailable; retry"
                ) from failure
            raise

    return guarded
