"""The serving loop is uvloop when installed and asked for (or `auto`), the standard loop otherwise."""

from __future__ import annotations

import asyncio
import builtins

import pytest

from mergebroker.eventloop import loop_kind, new_event_loop


@pytest.mark.parametrize("choice, kind", [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")])
def test_the_chosen_loop_kind_is_built(choice, kind):
    loop = new_event_loop(choice)
    try:
        assert loop_kind(loop) == kind
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()


def test_auto_falls_back_to_asyncio_without_uvloop_and_an_explicit_choice_fails(monkeypatch):
    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("uvloop is not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    loop = new_event_loop("auto")
    try:
        assert loop_kind(loop) == "asyncio"
    finally:
        loop.close()
    with pytest.raises(ImportError):
        new_event_loop("uvloop")
