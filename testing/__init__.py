"""A throw-away ztate control plane for the tests of worker authors.

Like ``temporalio.testing.WorkflowEnvironment``: ``ZtateEnvironment.start(policy)``
is an async context manager that starts a real control plane (a Postgres database,
embedded unless a server is given, a development CA, an HMAC keyring, the policy the
test gives, the transition service on a loopback port with mutual TLS) and hands out
one client per identity; everything is removed when it exits. Nothing is mocked.

For pytest, ``pytest_plugins = ["ztate.testing.pytest_plugin"]`` in a ``conftest.py``
gives the fixtures ``ztate_env`` and ``ztate_policy`` (docs/testing.md).

This package is part of the ``ztate`` distribution (it runs the control plane), not of
``ztate-worker``; nothing else in ztate imports it.
"""

from ztate.testing._env import ZtateEnvironment
from ztate.testing._ledger import Ledger, LedgerSnapshot
from ztate.testing._pki import TRUST_DOMAIN, Credentials, Pki

__all__ = [
    "TRUST_DOMAIN",
    "Credentials",
    "Ledger",
    "LedgerSnapshot",
    "Pki",
    "ZtateEnvironment",
]
