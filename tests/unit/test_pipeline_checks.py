"""The pipeline's pure checks, each with its one reason."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ztate.contract.canonical import parse_object
from ztate.services.policy.changes import apply_patch
from ztate.services.policy.model import Policy, PolicyDocument
from ztate.services.runtime import errors
from ztate.services.runtime.identity import Authenticator, Identity, Role, parse_spiffe_id
from ztate.transition_service.checks import (
    check_layers,
    check_size,
    check_storable,
    check_writable,
    request_digest,
)
from ztate.transition_service.heads import CachedHead, HeadCache
from ztate.transition_service.requests import Proposal


def test_apply_patch_sets_and_removes_without_touching_the_base() -> None:
    base = {"a": 1, "b": {"c": 2}}
    result = apply_patch(base, {"a": None, "b": {"d": 3}, "e": [1]})
    assert result == {"b": {"d": 3}, "e": [1]}
    assert base == {"a": 1, "b": {"c": 2}}


def test_check_writable_names_every_refused_key_sorted() -> None:
    with pytest.raises(errors.KeyNotWritable) as caught:
        check_writable({"z": 1, "ok": 2, "a": 3}, frozenset({"ok"}))
    assert caught.value.keys == ("a", "z")


def test_check_size_reports_the_limit() -> None:
    check_size(b"x" * 10, 10, "patch")
    with pytest.raises(errors.PatchTooLarge) as caught:
        check_size(b"x" * 11, 10, "patch")
    assert caught.value.limit == 10


def test_request_digest_separates_version_and_patch() -> None:
    a = Proposal("t", 1, b"2{}", "k")
    b = Proposal("t", 12, b"{}", "k")
    assert request_digest(a) != request_digest(b)


def test_head_cache_keeps_newest_and_evicts_least_recent() -> None:
    cache = HeadCache(2)
    cache.put("t1", CachedHead(1, "d1", {}, "p"))
    cache.put("t1", CachedHead(0, "d0", {}, "p"))  # an older head never replaces a newer one
    assert cache.get("t1", 1) is not None
    assert cache.get("t1", 0) is None
    cache.put("t2", CachedHead(0, "x", {}, "p"))
    cache.get("t1", 1)
    cache.put("t3", CachedHead(0, "y", {}, "p"))
    assert len(cache) == 2
    assert cache.get("t2", 0) is None  # least recently used went first


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("https://ztate.test/node/a", "not a SPIFFE ID"),
        ("spiffe://other.test/node/a", "trust domain 'other.test'"),
        ("spiffe://ztate.test/node", "must be /<role>/<name>"),
        ("spiffe://ztate.test/god/a", "unknown role 'god'"),
        ("spiffe://ztate.test/node/A_B", "identity name must match"),
    ],
)
def test_spiffe_id_parsing(uri: str, fragment: str) -> None:
    with pytest.raises(errors.IdentityInvalid) as caught:
        parse_spiffe_id(uri, "ztate.test")
    assert fragment in caught.value.message


def test_spiffe_id_round_trip() -> None:
    identity = parse_spiffe_id("spiffe://ztate.test/operator/admin", "ztate.test")
    assert identity == Identity("ztate.test", Role.OPERATOR, "admin")
    assert identity.spiffe_id == "spiffe://ztate.test/operator/admin"


def _unchecked_policy() -> Policy:
    """A policy whose layer grants loading would refuse: only ``check_layers`` stands."""
    document = PolicyDocument.model_validate(
        {
            "format": 1,
            "name": "unchecked",
            "keys": {
                "c": {"layer": "core", "type": "boolean"},
                "s": {"layer": "shared", "type": "boolean"},
                "w": {"layer": "working", "type": "boolean"},
            },
            "nodes": {"n": {"layer": "working", "write": ["c", "s", "w"]}},
        }
    )
    return Policy(document, b"{}", [], [])  # the body: what its digest is taken over


@pytest.mark.parametrize(
    ("key", "fragment"),
    [("c", "is a core key"), ("s", "above this node's layer working")],
)
def test_layers_are_enforced_on_every_proposal_even_if_granted(key: str, fragment: str) -> None:
    policy = _unchecked_policy()
    check_layers({"w": True}, policy, "n")
    with pytest.raises(errors.LayerViolation) as caught:
        check_layers({"w": True, key: True}, policy, "n")
    assert caught.value.keys == (key,)
    assert fragment in caught.value.message


@pytest.mark.parametrize(
    "source",
    [
        rb'{"a":"x\u0000"}',
        rb'{"a\u0000":1}',
        rb'{"a":[{"b":"\u0000"}]}',
        rb'{"a":"\\\u0000"}',  # an escaped backslash, then the escape itself
    ],
)
def test_check_storable_refuses_u0000_in_a_string_or_name_when_given_its_source(
    source: bytes,
) -> None:
    value = parse_object(source, what="patch")
    with pytest.raises(errors.UnsupportedCharacter):
        check_storable(value, "patch", source)


def test_check_storable_walks_a_source_that_merely_spells_the_escape() -> None:
    source = rb'{"a":"\\u0000"}'  # a backslash, then the letters u0000: no U+0000
    value = parse_object(source, what="patch")
    assert value == {"a": "\\u0000"}
    check_storable(value, "patch", source)


def _holds_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


_TEXT = st.text(st.characters(exclude_categories=("Cs",)))


@given(
    st.recursive(
        _TEXT | st.integers(-5, 5),
        lambda inner: st.dictionaries(_TEXT, inner) | st.lists(inner),
    )
)
def test_text_without_the_escape_never_parses_to_u0000(value: object) -> None:
    """What lets ``check_storable`` skip its walk: JSON text holds U+0000 only as
    the escape, whatever the encoder (here the standard library's, ASCII or not)."""
    for ensure_ascii in (True, False):
        source = json.dumps({"k": value}, ensure_ascii=ensure_ascii).encode("utf-8")
        parsed = parse_object(source, what="patch")
        if b"\\u0000" not in source:
            assert not _holds_nul(parsed)


@pytest.mark.parametrize("pems", [[], [b"one", b"two"], [b"not a certificate"]])
def test_a_call_whose_certificate_cannot_be_read_is_refused(pems: list[bytes]) -> None:
    """The credential check reads the caller's certificate (its dates, its serial): TLS
    verified exactly one, but a context without one readable must fail closed, not skip
    the expiry and serial checks."""
    authenticator = Authenticator("ztate.test")
    caller = Identity("ztate.test", Role.NODE, "planner")
    auth = {"transport_security_type": [b"ssl"], "x509_pem_cert": pems}
    with pytest.raises(errors.IdentityInvalid, match="the caller's certificate cannot be read"):
        authenticator.check_credential(None, caller, auth)  # type: ignore[arg-type]
