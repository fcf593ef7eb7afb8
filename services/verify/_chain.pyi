"""The verifier's compiled lane (_chain.c): the lines it confirms whole, it takes."""

from collections.abc import Callable
from typing import Any

Policies = dict[str, tuple[str, bool, tuple[tuple[str, tuple[bytes, ...] | None], ...]]]
Last = tuple[int, str, str, bool]

class Lane:
    def __init__(
        self,
        keys: dict[str, bytes] | None,
        policies: Policies,
        role_ok: Callable[[str, str], bool],
        derive: Callable[[str, bytes, bytes, bytes, str], bool],
    ) -> None: ...
    def start(
        self,
        thread_id: bytes,
        expected: int,
        parent: str,
        state: bytes,
        policy_name: str | None,
        stop: int,
        /,
    ) -> bool: ...
    def add(self, line: bytes, /) -> bool: ...
    def feed(self, block: bytes, pos: int, /) -> tuple[int, int, int]: ...
    def add_rows(self, rows: list[Any], start: int, /) -> tuple[int, int, int]: ...
    def take(self) -> tuple[int, int, str, bytes, str | None, str, Last | None]: ...

def canonical(data: bytes, /) -> bool: ...
