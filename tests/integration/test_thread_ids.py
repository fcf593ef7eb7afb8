"""Thread ids are validated whole: a trailing newline is not "the end of the line".

``re.match`` with ``$`` accepts ``"t-1\\n"``; the service must refuse it as it
refuses any other character outside ``[A-Za-z0-9._:-]``, and write nothing.
"""

from __future__ import annotations

import pytest

from tests.harness import INITIAL, Ledger, Pki, client, new_thread_id
from ztate.worker_sdk import InvalidRequest

THREAD_ID_ERROR = "thread_id must be 1-128 characters of [A-Za-z0-9._:-]"


async def test_a_thread_id_with_a_trailing_newline_is_refused_and_nothing_is_written(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = new_thread_id() + "\n"
    async with client(target, pki.operator()) as operator:
        with pytest.raises(InvalidRequest) as refused:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    assert refused.value.reason == "REQUEST_INVALID"
    assert THREAD_ID_ERROR in str(refused.value)
    for written in (thread_id, thread_id.rstrip("\n")):
        snapshot = await ledger.snapshot(written)
        assert (snapshot.head_version, snapshot.transitions) == (None, 0)

    async with client(target, pki.node("input-parser")) as worker:
        with pytest.raises(InvalidRequest) as refused:
            await worker.propose(thread_id, 0, {"requested_action": {"action": "refund"}})
    assert refused.value.reason == "REQUEST_INVALID"
    assert THREAD_ID_ERROR in str(refused.value)
    assert (await ledger.snapshot(thread_id)).transitions == 0


async def test_an_idempotency_key_with_a_trailing_newline_is_refused_and_nothing_is_written(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("input-parser")) as worker:
        with pytest.raises(InvalidRequest) as refused:
            await worker.propose(
                thread_id,
                0,
                {"requested_action": {"action": "refund"}},
                idempotency_key="retry-1\n",
            )
    assert refused.value.reason == "REQUEST_INVALID"
    assert "idempotency_key must be 1-128 printable ASCII characters" in str(refused.value)
    snapshot = await ledger.snapshot(thread_id)
    assert (snapshot.head_version, snapshot.transitions) == (0, 1)
