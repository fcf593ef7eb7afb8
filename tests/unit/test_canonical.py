"""ztate.contract.canonical: JCS bytes identical to the reference, and the strict parser's refusals.

``canonical_bytes`` takes a faster path than ``rfc8785`` for some values; the
properties here check that the two agree byte for byte over the I-JSON domain.
Member names are drawn so that UTF-16 and code point order disagree (non-BMP
characters against U+E000-U+FFFF), and numbers cover both integer bounds, -0.0,
subnormals and extreme exponents.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import orjson
import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from ztate.contract.canonical import (
    DEFAULT_MAX_DEPTH,
    MAX_SAFE_INTEGER,
    canonical_bytes,
    hashed_name,
    orjson_canonical,
    parse_object,
    sha256_hex,
)
from ztate.contract.errors import ContractError, JsonMalformed, JsonOutOfRange
from ztate.services.runtime import errors
from ztate.services.runtime.errors import PatchMalformed, ValueOutOfRange
from ztate.transition_service.checks import parse_admitted

PROPERTY = settings(max_examples=300, deadline=None)

CHARS = st.one_of(
    st.characters(min_codepoint=0x00, max_codepoint=0x7F),  # ASCII with controls and DEL
    st.characters(min_codepoint=0x80, max_codepoint=0xD7FF),
    st.characters(min_codepoint=0xE000, max_codepoint=0xFFFF),  # after surrogates in UTF-16
    st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF),  # a surrogate pair in UTF-16
)
TEXT = st.text(CHARS, max_size=12)
# Code point order puts U+E000-U+FFFF before non-BMP characters; UTF-16 order, which
# JCS uses, puts them after (a surrogate pair starts with 0xD800-0xDBFF).
EDGE_NAMES = ["", "a", "\x00", "\x7f", "\u20ac", "\ue000", "\ufb33", "\uffff"]
EDGE_NAMES += ["\U00010000", "\U0001f600", "\U0010ffff", "a\U0001f600", "a\uffff"]
NAMES = st.one_of(TEXT, st.sampled_from(EDGE_NAMES))
INTEGERS = st.one_of(
    st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER),
    st.sampled_from([MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, 0, -1, 2**31, 2**32, 2**52]),
)
EDGE_FLOATS = [
    0.0,
    -0.0,
    5e-324,  # smallest subnormal
    -5e-324,
    2.225073858507201e-308,  # largest subnormal
    2.2250738585072014e-308,  # smallest normal
    1.7976931348623157e308,
    -1.7976931348623157e308,
    1e21,  # first power of ten written with an exponent
    1e-7,  # first negative power of ten written with an exponent
    1e-6,
    0.1,
    1 / 3,
    4.0,
    9007199254740992.0,
    1e20,
    123456789012345680000.0,
]
FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(EDGE_FLOATS),
    st.builds(
        lambda mantissa, exponent: float(f"{mantissa}e{exponent}"),
        st.integers(1, 10**17),
        st.integers(-340, 292),
    ).filter(math.isfinite),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTEGERS, FLOATS, TEXT)


def json_values(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=5), st.dictionaries(NAMES, children, max_size=5)
        ),
        max_leaves=16,
    )


VALUES = json_values(SCALARS)


def _admitted(number: float) -> bool:
    # JCS writes an integral double in [2^53, 1e21) as a bare integer literal beyond
    # +/-(2^53 - 1), so parse_object refuses such doubles at the door (a signed record
    # must re-parse to itself). The reference comparisons above still cover them.
    return not (number.is_integer() and 2**53 <= abs(number) < 1e21)


ADMITTED_OBJECTS = st.dictionaries(
    NAMES,
    json_values(st.one_of(st.none(), st.booleans(), INTEGERS, FLOATS.filter(_admitted), TEXT)),
    max_size=3,
)


# --- identical to the reference --------------------------------------------------------


@PROPERTY
@given(VALUES)
def test_canonical_bytes_is_the_reference_for_any_value(value: Any) -> None:
    assert canonical_bytes(value) == rfc8785.dumps(value)


@PROPERTY
@given(st.dictionaries(NAMES, SCALARS, min_size=2, max_size=12))
def test_member_order_is_utf16_code_unit_order(obj: dict[str, Any]) -> None:
    encoded = canonical_bytes(obj)
    assert encoded == rfc8785.dumps(obj)
    order = sorted(obj, key=lambda name: name.encode("utf-16-be"))
    assert list(json.loads(encoded)) == order


@PROPERTY
@given(ADMITTED_OBJECTS, st.sampled_from([None, 0, 2]), st.booleans())
def test_any_json_spelling_parses_to_the_same_canonical_bytes(
    obj: dict[str, Any], indent: int | None, ensure_ascii: bool
) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii)
    parsed = parse_object(text.encode(), what="patch", max_depth=64)
    assert canonical_bytes(parsed) == rfc8785.dumps(obj)


@PROPERTY
@given(ADMITTED_OBJECTS)
def test_canonical_bytes_are_a_fixed_point(obj: dict[str, Any]) -> None:
    encoded = canonical_bytes(obj)
    assert canonical_bytes(parse_object(encoded, what="record", max_depth=64)) == encoded


# --- RFC 8785 examples, independent of any implementation ------------------------------

# RFC 8785 Appendix B: IEEE 754 bit patterns and their JCS form.
APPENDIX_B = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


# --- orjson_canonical: canonical form recognised without a walk -------------------------


def _encodings(value: dict[str, Any]) -> list[bytes]:
    """Bytes that parse to ``value``: orjson's (sorted and not) and json's."""
    out = [
        orjson.dumps(value, option=orjson.OPT_SORT_KEYS),
        orjson.dumps(value),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"
        ),
    ]
    return out


@PROPERTY
@given(st.dictionaries(NAMES, VALUES, max_size=4))
def test_orjson_canonical_is_never_wrong(value: dict[str, Any]) -> None:
    # True only when the bytes are exactly the reference's canonical form
    for data in _encodings(value):
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if orjson_canonical(data, parsed):
            assert data == rfc8785.dumps(parsed)


@PROPERTY
@given(st.dictionaries(TEXT, json_values(st.one_of(st.none(), st.booleans(), INTEGERS, TEXT))))
def test_orjson_canonical_recognises_the_fast_path(value: dict[str, Any]) -> None:
    data = canonical_bytes(value)
    safe = all(abs(n) < 10**15 for n in _integers(value)) and not any(
        ord(c) > 0xFFFF for c in data.decode("utf-8", "surrogatepass")
    )
    assert orjson_canonical(data, orjson.loads(data)) or not safe


def _integers(value: Any) -> list[int]:
    if type(value) is int:
        return [value]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _integers(item)]
    if isinstance(value, list):
        return [n for item in value for n in _integers(item)]
    return []


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":1.0}',
        b'{"a":[1e21]}',
        b'{"a":{"b":-0.5e-7}}',
        b'{"a":9007199254740992}',
        b'{"\xee\x80\x80":1,"\xf0\x9f\x98\x80":2}',
    ],
)
def test_orjson_canonical_sends_floats_large_integers_and_non_bmp_names_elsewhere(
    data: bytes,
) -> None:
    assert not orjson_canonical(data, orjson.loads(data))


def test_orjson_canonical_ignores_numbers_inside_strings() -> None:
    data = b'{"at":"2026-11-01T00:00:01.000000Z","n":12,"s":"x:1.5,\\n"}'
    assert orjson_canonical(data, orjson.loads(data))


@pytest.mark.parametrize(("bits", "expected"), APPENDIX_B)
def test_rfc8785_appendix_b_numbers(bits: str, expected: str) -> None:
    (number,) = struct.unpack(">d", bytes.fromhex(bits))
    assert canonical_bytes(number) == expected.encode()
    assert canonical_bytes({"n": [number]}) == b'{"n":[' + expected.encode() + b"]}"


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_have_no_canonical_form(number: float) -> None:
    with pytest.raises(rfc8785.FloatDomainError, match="is not representable in JCS"):
        canonical_bytes({"n": number})


def test_rfc8785_sorting_example() -> None:
    obj = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    expected = (
        '{"\\r":"Carriage Return","1":"One","\u0080":"Control",'
        '"\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign",'
        '"\U0001f600":"Emoji: Grinning Face","\ufb33":"Hebrew Letter Dalet With Dagesh"}'
    )
    assert canonical_bytes(obj) == expected.encode()


def test_rfc8785_main_example_through_the_parser() -> None:
    data = (
        b'{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        b' "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        b' "literals": [null, true, false]}'
    )
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    ).encode()
    assert canonical_bytes(parse_object(data, what="patch")) == expected


def test_sha256_hex_is_lower_case_hex() -> None:
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


# --- what parse_object refuses ---------------------------------------------------------


def nested(depth: int) -> bytes:
    """An object whose containers nest ``depth`` levels, the outer object included."""
    return b'{"a":' * (depth - 1) + b"{}" + b"}" * (depth - 1)


REFUSED = [
    pytest.param(b'{"a":"\xff"}', PatchMalformed, "patch is not valid UTF-8 (byte 6)", id="utf8"),
    pytest.param(
        b'{"a":"\xed\xa0\x80"}',
        PatchMalformed,
        "patch is not valid UTF-8 (byte 6)",
        id="utf8-encoded-surrogate",
    ),
    pytest.param(
        b'{"a":}',
        PatchMalformed,
        "patch is not valid JSON: Expecting value (line 1, column 6)",
        id="not-json",
    ),
    pytest.param(b"", PatchMalformed, "patch is not valid JSON", id="empty"),
    pytest.param(b'{"a":1}{}', PatchMalformed, "patch is not valid JSON: Extra data", id="extra"),
    pytest.param(b"[1]", PatchMalformed, "patch must be a JSON object", id="top-list"),
    pytest.param(b'"text"', PatchMalformed, "patch must be a JSON object", id="top-string"),
    pytest.param(b"null", PatchMalformed, "patch must be a JSON object", id="top-null"),
    pytest.param(b"42", PatchMalformed, "patch must be a JSON object", id="top-number"),
    pytest.param(b'{"a":1,"a":2}', PatchMalformed, "duplicate member name a", id="duplicate"),
    pytest.param(
        b'{"x":{"b":1,"b":1}}', PatchMalformed, "duplicate member name b", id="duplicate-nested"
    ),
    pytest.param(
        b'{"x":[{"\\u00e9":1,"\xc3\xa9":2}]}',
        PatchMalformed,
        # not a plain name: shown by digest, never verbatim
        "duplicate member name sha256:4a99557e4033c353",
        id="duplicate-in-list-escaped-vs-raw",
    ),
    pytest.param(
        b'{"a":"\\ud800"}', PatchMalformed, "patch holds a lone surrogate", id="lone-surrogate"
    ),
    pytest.param(
        b'{"a":["x\\udfff"]}',
        PatchMalformed,
        "patch holds a lone surrogate",
        id="lone-low-surrogate",
    ),
    pytest.param(
        b'{"\\udc00":1}', PatchMalformed, "patch holds a lone surrogate", id="lone-surrogate-name"
    ),
    pytest.param(
        b'{"a":9007199254740992}',
        ValueOutOfRange,
        "patch holds an integer outside the I-JSON range +/-(2^53 - 1)",
        id="2**53",
    ),
    pytest.param(
        b'{"a":[-9007199254740992]}',
        ValueOutOfRange,
        "patch holds an integer outside the I-JSON range +/-(2^53 - 1)",
        id="-(2**53)",
    ),
    pytest.param(
        b'{"a":1e400}', ValueOutOfRange, "patch holds a number too large for a double", id="1e400"
    ),
    pytest.param(
        b'{"a":-1E400}',
        ValueOutOfRange,
        "patch holds a number too large for a double",
        id="-1e400",
    ),
    pytest.param(
        b'{"a":NaN}', ValueOutOfRange, "patch holds NaN, which is not a JSON number", id="nan"
    ),
    pytest.param(
        b'{"a":Infinity}',
        ValueOutOfRange,
        "patch holds Infinity, which is not a JSON number",
        id="inf",
    ),
    pytest.param(
        b'{"a":[-Infinity]}',
        ValueOutOfRange,
        "patch holds -Infinity, which is not a JSON number",
        id="-inf",
    ),
    pytest.param(
        b'{"a":1e20}',
        ValueOutOfRange,
        "patch holds an integer outside the I-JSON range +/-(2^53 - 1)",
        id="1e20-integral-double",
    ),
    pytest.param(
        b'{"a":9007199254740993.0}',
        ValueOutOfRange,
        "patch holds an integer outside the I-JSON range +/-(2^53 - 1)",
        id="2**53+1-as-float",
    ),
    pytest.param(
        b'{"a":1e-400}',
        ValueOutOfRange,
        "patch holds a number too small for a double (it would round to 0)",
        id="underflow",
    ),
    pytest.param(
        b'{"a":' + b"1" * 5000 + b"}",
        ValueOutOfRange,
        "patch holds an integer outside the I-JSON range +/-(2^53 - 1)",
        id="5000-digits",
    ),
    pytest.param(
        b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        ValueOutOfRange,
        "patch nests deeper than 32 levels",
        id="recursion-limit",
    ),
]


@pytest.mark.parametrize(("data", "error", "message"), REFUSED)
def test_parse_object_refuses(data: bytes, error: type[Exception], message: str) -> None:
    """As the transition service admits a patch: the contract's refusal, told to the
    caller as its domain reason, a duplicate name shown as the rejections ledger may."""
    with pytest.raises(error) as refused:
        parse_admitted(data, "patch", DEFAULT_MAX_DEPTH)
    assert message in str(refused.value)
    with pytest.raises(ContractError) as raw:
        parse_object(data, what="patch")
    assert type(errors.from_contract(raw.value)) is error


def test_the_contract_alone_never_repeats_a_member_name() -> None:
    with pytest.raises(JsonMalformed) as refused:
        parse_object(b'{"password":1,"password":2}', what="patch")
    assert "password" not in refused.value.message
    assert refused.value.message == f"duplicate member name {hashed_name('password')}"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"a":9007199254740991}', {"a": MAX_SAFE_INTEGER}),
        (b'{"a":-9007199254740991}', {"a": -MAX_SAFE_INTEGER}),
        (b'{"a":1.7976931348623157e308}', {"a": 1.7976931348623157e308}),
        (b'{"a":"\\ud83d\\ude00"}', {"a": "\U0001f600"}),
        (b'{"a":"\xf0\x9f\x98\x80"}', {"a": "\U0001f600"}),
        (b'{"a":{"a":1},"b":[{"a":1},{"a":1}]}', {"a": {"a": 1}, "b": [{"a": 1}, {"a": 1}]}),
    ],
)
def test_parse_object_admits(data: bytes, expected: dict[str, Any]) -> None:
    assert parse_object(data, what="patch") == expected


@pytest.mark.parametrize("max_depth", [1, 3, 32])
def test_nesting_up_to_max_depth_is_admitted_and_one_more_is_refused(max_depth: int) -> None:
    admitted = parse_object(nested(max_depth), what="patch", max_depth=max_depth)
    assert canonical_bytes(admitted) == nested(max_depth)
    with pytest.raises(JsonOutOfRange, match=f"patch nests deeper than {max_depth} levels"):
        parse_object(nested(max_depth + 1), what="patch", max_depth=max_depth)


def test_lists_count_towards_depth() -> None:
    assert parse_object(b'{"a":[[]]}', what="patch", max_depth=3) == {"a": [[]]}
    with pytest.raises(JsonOutOfRange, match="patch nests deeper than 3 levels"):
        parse_object(b'{"a":[[[]]]}', what="patch", max_depth=3)
