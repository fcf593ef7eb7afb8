"""What every ztate gRPC server sets, in one place: message limits, keepalive, an exclusive
port, a short TLS handshake timeout, and as many open files as the process may have.

A connection that never starts (or never finishes) its TLS handshake holds a file
descriptor until the server gives up on it: gRPC's default is 120 s, long enough for
a thousand idle sockets to exhaust a 1,024-file limit and block every legitimate
worker. Both services close such connections after ``handshake_timeout_seconds``
(default 5 s) and raise their soft open-file limit to the hard one at start-up.
"""

from __future__ import annotations

import logging
import resource
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import grpc
    from google.protobuf.message import Message as ProtoMessage

log = logging.getLogger("ztate.serving")

# The approval service's request and reply limit. Its largest request is a review's
# submission: the proposal, and the record and state it builds on, which a large state
# limit (ZTATE_MAX_STATE_BYTES, up to 64 MiB) can take past this; the transition
# service's outbox sets such a submission aside rather than send it.
APPROVAL_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def server_options(
    *,
    max_request_bytes: int,
    max_reply_bytes: int,
    handshake_timeout_seconds: float,
    max_connection_age_seconds: float,
    connection_grace_seconds: float,
) -> list[tuple[str, int]]:
    """gRPC server options shared by the transition and approval services."""
    return [
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", max_reply_bytes),
        # a second process on the same address must fail, not silently share it
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # a connection that has not completed TLS by then is closed, freeing its file
        ("grpc.server_handshake_timeout_ms", int(handshake_timeout_seconds * 1000)),
        # TLS checks a client's chain once, when it connects: a connection made under a
        # CA since removed from the bundle would serve on for as long as it lasts. After
        # this age the server asks the client to connect again (GOAWAY; gRPC adds some
        # jitter), lets its calls and streams run on for the grace, then closes it; the
        # new connection is checked from scratch (expiry and revocation are checked at
        # every call already: identity.Authenticator)
        ("grpc.max_connection_age_ms", int(max_connection_age_seconds * 1000)),
        ("grpc.max_connection_age_grace_ms", int(connection_grace_seconds * 1000)),
    ]


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as refused:
            log.warning("could not raise the open-file limit above %d: %s", soft, refused)
    log.info("open-file limit %d (each connection holds one)", soft)
    return soft


class CannotListen(OSError):
    """An address a server cannot listen on: in use (another ztate on it?) or not one
    of this host's."""


def listen_on(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials) -> int:
    """``server.add_secure_port``, failing with ``CannotListen`` (gRPC raises a
    RuntimeError on an address it cannot bind; older versions returned 0)."""
    try:
        port: int = server.add_secure_port(listen, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise CannotListen(f"cannot listen on {listen} (in use, or no address of this host)")
    return port


Message = TypeVar("Message", bound="ProtoMessage")


def within_budget(messages: list[Message], budget: int) -> list[Message]:
    """The longest prefix of ``messages`` whose encoding fits ``budget`` bytes (always
    at least one: a row is bounded by the state limit, which the budget exceeds). A page
    of large rows is shorter, with a next token, never an error."""
    kept: list[Message] = []
    size = 0
    for message in messages:
        size += message.ByteSize() + 16  # the field tag and length prefix, generously
        if kept and size > budget:
            break
        kept.append(message)
    return kept
