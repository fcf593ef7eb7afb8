"""A bounded cache of recent thread heads.

Entries are immutable snapshots keyed by (thread, version). A cached head can
only be stale, never wrong: a record at a given version never changes, and the
commit's compare-and-swap refuses a head that moved. A stale entry costs one
re-read, not a wrong commit, so replicas need no cache coherence.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ztate.contract.canonical import JsonObject


@dataclass(frozen=True, slots=True)
class CachedHead:
    version: int
    digest: str
    state: JsonObject
    policy_name: str


class HeadCache:
    """Least-recently-used heads by thread id."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, CachedHead] = OrderedDict()

    def get(self, thread_id: str, version: int) -> CachedHead | None:
        entry = self._entries.get(thread_id)
        if entry is None or entry.version != version:
            return None
        self._entries.move_to_end(thread_id)
        return entry

    def put(self, thread_id: str, head: CachedHead) -> None:
        if self._capacity == 0:
            return
        current = self._entries.get(thread_id)
        if current is not None and current.version > head.version:
            return
        self._entries[thread_id] = head
        self._entries.move_to_end(thread_id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
