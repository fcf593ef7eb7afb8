"""The one rule for thread ids, for every service that takes one from a caller."""

from __future__ import annotations

import re

from ztate.services.runtime import errors

THREAD_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # fullmatch: "$" would take a "\n"


def check_thread_id(thread_id: str) -> None:
    """``RequestInvalid`` unless ``thread_id`` is 1-128 characters of [A-Za-z0-9._:-]."""
    if not THREAD_ID.fullmatch(thread_id):
        raise errors.RequestInvalid("thread_id must be 1-128 characters of [A-Za-z0-9._:-]")
