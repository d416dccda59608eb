"""`mergebroker.jsonio` reads and writes what the standard library did, only faster."""

from __future__ import annotations

import json

import pytest

from mergebroker import jsonio


def test_round_trip_of_an_ordinary_body_matches_the_standard_library():
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo \u2603"}], "temperature": 0.5, "n": 1}
    assert json.loads(jsonio.dumps(body)) == body
    assert jsonio.loads(json.dumps(body).encode()) == body


def test_huge_integers_and_nan_literals_still_parse_through_the_fallback():
    assert jsonio.loads(b'{"seed": 123456789012345678901234567890}')["seed"] == 123456789012345678901234567890
    assert jsonio.loads(b"[NaN]")[0] != jsonio.loads(b"[NaN]")[0]  # NaN, as `json` reads it


def test_huge_integers_are_written_by_the_fallback():
    assert json.loads(jsonio.dumps({"seed": 2 ** 70})) == {"seed": 2 ** 70}


@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe", b"[1,]"])
def test_bad_input_raises_a_value_error(raw):
    with pytest.raises(ValueError):
        jsonio.loads(raw)
