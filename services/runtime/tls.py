"""Mutual TLS for every ztate port and every call between ztate processes.

Servers require a client certificate signed by the configured CA (verified in
the handshake); clients present their own certificate and verify the server's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc


def server_credentials(cert: Path, key: Path, ca: Path) -> grpc.ServerCredentials:
    """A client certificate signed by ``ca`` is required of every caller."""
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=ca.read_bytes(),
        require_client_auth=True,
    )


# The largest reply any ztate server can be configured to send (Settings.max_reply_bytes
# at the highest state and patch limits): clients accept it, so no legal reply is cut.
MAX_REPLY_BYTES = 64 * 1024 * 1024 + 2 * 4 * 1024 * 1024 + 64 * 1024


def client_channel(
    target: str, cert: Path, key: Path, ca: Path, *, server_name: str | None = None
) -> grpc.aio.Channel:
    """A channel authenticated as the identity in ``cert``."""
    credentials = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_REPLY_BYTES)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, credentials, options=options)
