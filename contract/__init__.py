"""The byte formats of ztate, once: what the services write, what workers and auditors check.

Pure functions over bytes, with their own error types (``ztate.contract.errors``),
depending on nothing but the standard library, ``rfc8785`` and ``cryptography``
(and ``orjson``, when installed, as a canonical-JSON fast path proven equal to the
reference). Both services, the worker SDK and the offline verifier import these
modules; no other copy of a format exists. The documents that define them are
docs/ledger-format.md (records, the chain, the transition digest),
docs/approvals.md (receipts) and docs/verification.md (checkpoints, key files);
tests/vectors/ holds fixed vectors, one file per way to be right or wrong.

- ``canonical``: RFC 8785 canonical JSON and the strict I-JSON parser;
- ``record``: the ledger record, its digest and HMAC signature, the transition digest;
- ``receipts``: approval receipts (Ed25519) and what binds one to a record;
- ``checkpoints``: signed thread heads (Ed25519);
- ``keyring``: the HMAC keyring and the Ed25519 key files.
"""
