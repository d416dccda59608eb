"""`direct_init` keeps a frozen dataclass what it was (signature, defaults, factories, frozen, equality,
hash, `__post_init__`) while building it without a `object.__setattr__` call per field, and refuses the
classes it cannot serve."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field

import pytest

from mergebroker.frozen_init import direct_init


@direct_init
@dataclass(frozen=True)
class _Value:
    name: str
    tags: list[str] = field(default_factory=list)
    size: int = 1
    derived: int = field(default=0, init=False)
    note: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "derived", self.size * 10)


def test_it_builds_what_the_dataclass_would_with_every_kind_of_field():
    value = _Value("a", ["x"], 3, note="n")
    assert (value.name, value.tags, value.size, value.derived, value.note) == ("a", ["x"], 3, 30, "n")
    default = _Value("b")
    assert (default.tags, default.size, default.derived, default.note) == ([], 1, 10, None)
    assert _Value("c").tags is not _Value("c").tags  # a factory per instance, never one shared list
    assert dataclasses.replace(value, size=4).derived == 40


def test_the_value_stays_frozen_equal_and_printable():
    value = _Value("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.size = 2  # type: ignore[misc]
    assert value == _Value("a") and value != _Value("b")
    assert repr(value) == "_Value(name='a', tags=[], size=1, derived=10, note=None)"


def test_the_signature_is_the_dataclasss_so_callers_get_the_same_errors():
    with pytest.raises(TypeError):
        _Value()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Value("a", [], 1, None)  # type: ignore[misc]  # note is keyword-only
    with pytest.raises(TypeError):
        _Value("a", derived=5)  # type: ignore[call-arg]


def test_classes_it_cannot_serve_are_refused_at_definition():
    with pytest.raises(TypeError, match="frozen"):
        direct_init(dataclass(type("Loose", (), {"__annotations__": {"a": int}})))
    with pytest.raises(TypeError, match="slots"):
        @direct_init
        @dataclass(frozen=True, slots=True)
        class Slotted:
            a: int
    with pytest.raises(TypeError, match="would not take"):
        @direct_init
        @dataclass(frozen=True)
        class WithInitVar:
            a: int
            scale: InitVar[int] = 1
