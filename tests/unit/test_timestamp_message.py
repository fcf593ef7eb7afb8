"""``timestamp_message``: the one conversion of a moment to a protobuf Timestamp on
the answer path, held equal to protobuf's own ``FromDatetime``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf import timestamp_pb2

from ztate.transition_service.ledger_server import timestamp_message

MOMENTS = [
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(1970, 1, 1, tzinfo=UTC) - timedelta(microseconds=1),  # before the epoch
    datetime(1969, 7, 20, 20, 17, 40, 123456, tzinfo=UTC),
    datetime(2026, 11, 25, 22, 30, 1, 999999, tzinfo=UTC),
    datetime(2026, 11, 25, 23, 30, 1, 5, tzinfo=timezone(timedelta(hours=1))),  # not UTC
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(1, 1, 1, tzinfo=UTC),
]


@pytest.mark.parametrize("moment", MOMENTS, ids=str)
def test_a_moment_converts_as_protobuf_converts_it(moment: datetime) -> None:
    expected = timestamp_pb2.Timestamp()
    expected.FromDatetime(moment)
    assert timestamp_message(moment) == expected
    assert timestamp_message(moment).ToDatetime(tzinfo=UTC) == moment
