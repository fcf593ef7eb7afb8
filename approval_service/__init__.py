"""The approval service: human decisions bound to one exact transition.

Its own process (``ztate approval-serve``), identity, database schema and role,
and Ed25519 signing key. It collects reviewers' decisions on parked transitions
and signs receipts; it can never write state. See docs/approvals.md.
"""
