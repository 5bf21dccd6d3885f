"""distdiag/report/fastjson.py: orjson where it parses, json.loads where it does not; every
value parses to what json.loads makes of it."""

from __future__ import annotations

import json
import math
import random

import pytest

from distdiag.report import fastjson


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.randrange(-2**40, 2**40)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-8, 8)
    if kind == 2:
        return "".join(rng.choice("ab\u00e9\u4e2d\"\\/\n ") for _ in range(rng.randrange(6)))
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return round(rng.random(), 6)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randrange(4))}


def test_values_parse_as_json_loads_parses_them():
    rng = random.Random(21)
    for _ in range(300):
        text = json.dumps(_value(rng))
        assert fastjson.loads(text) == json.loads(text)
        assert fastjson.loads(text.encode()) == json.loads(text.encode())


def test_what_orjson_refuses_the_standard_parser_reads():
    """NaN and the infinities (the numeric probes' evidence): as json.loads reads them."""
    got = fastjson.loads('{"loss": NaN, "grad": Infinity, "low": -Infinity, "n": 2}')
    assert math.isnan(got["loss"]) and got["grad"] == math.inf and got["low"] == -math.inf and got["n"] == 2


def test_integers_in_64_bits_stay_integers():
    """Nanosecond clocks, digests: exact; past 64 bits orjson gives a float (documented)."""
    for n in (2**63 - 1, 2**64 - 1, -2**63, 1_764_000_000_123_456_789):
        got = fastjson.loads(f"[{n}]")[0]
        assert got == n and type(got) is int
    assert fastjson.loads(f"[{2**64}]")[0] == 2**64


def test_text_in_another_encoding_reads_and_bad_json_still_raises():
    assert fastjson.loads('{"a": [1, 2]}'.encode("utf-16")) == {"a": [1, 2]}
    with pytest.raises(json.JSONDecodeError):
        fastjson.loads(b'{"a": ')
