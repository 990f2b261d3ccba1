"""addon/hook_table.py dispatches every event exactly as mitmproxy's own ``trigger_event`` does:
the same handlers, in chain order (sub-addons included), an addon's error logged and the next
addon still called, ``AddonHalt`` stopping the event; and it sees every change of the chain
(register, remove, a script loader's reorder at configure). A few ms, no proxy started."""

from __future__ import annotations

import asyncio
import logging

import pytest
from mitmproxy import exceptions
from mitmproxy.proxy.layers.http import HttpRequestHook
from mitmproxy.test import taddons, tflow

from addon.hook_table import HookTable


class Recorder:
    def __init__(self, name: str, calls: list[str], *, fail: bool = False, halt: bool = False):
        self.name, self.calls, self.fail, self.halt = name, calls, fail, halt

    def request(self, flow) -> None:
        self.calls.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} broke")
        if self.halt:
            raise exceptions.AddonHalt()


class AsyncRecorder(Recorder):
    async def request(self, flow) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        self.calls.append(self.name)


class Parent:
    """An addon with sub-addons (as mitmproxy's script loader holds scripts)."""

    def __init__(self, calls: list[str], children: list[object]):
        self.calls, self.addons = calls, children

    def request(self, flow) -> None:
        self.calls.append("parent")


class Quiet:
    """An addon without the hook: skipped."""

    name = "quiet"


def _trigger(tctx, table: HookTable | None = None) -> None:
    event = HttpRequestHook(tflow.tflow())
    asyncio.run((table.trigger_event if table else tctx.master.addons.trigger_event)(event))


def _both(addons_factory) -> tuple[list[str], list[str]]:
    """The calls mitmproxy's dispatch makes, and the calls the table makes, on equal chains."""
    out = []
    for use_table in (False, True):
        calls: list[str] = []
        with taddons.context(*addons_factory(calls)) as tctx:
            table = HookTable(tctx.master.addons) if use_table else None
            if table:
                table.install()
            _trigger(tctx)
        out.append(calls)
    return out[0], out[1]


def test_same_handlers_in_the_same_order():
    def chain(calls):
        return [Recorder("a", calls), Quiet(), Parent(calls, [Recorder("child", calls)]),
                AsyncRecorder("async", calls), Recorder("z", calls)]
    original, tabled = _both(chain)
    assert original == ["a", "parent", "child", "async", "z"]
    assert tabled == original


def test_an_addon_error_is_logged_and_the_next_addon_runs(caplog):
    def chain(calls):
        return [Recorder("a", calls, fail=True), Recorder("b", calls)]
    with caplog.at_level(logging.ERROR):
        original, tabled = _both(chain)
    assert tabled == original == ["a", "b"]
    assert sum("Addon error: a broke" in r.getMessage() for r in caplog.records) == 2  # once per dispatch


def test_addon_halt_stops_the_event():
    def chain(calls):
        return [Recorder("a", calls, halt=True), Recorder("b", calls)]
    original, tabled = _both(chain)
    assert tabled == original == ["a"]


def test_register_and_remove_change_what_is_called():
    calls: list[str] = []
    with taddons.context(Recorder("a", calls)) as tctx:
        table = HookTable(tctx.master.addons)
        table.install()
        _trigger(tctx)
        b = Recorder("b", calls)
        tctx.master.addons.add(b)  # add() registers: the table is rebuilt
        _trigger(tctx)
        tctx.master.addons.remove(b)
        _trigger(tctx)
        assert calls == ["a", "a", "b", "a"]
        assert table.builds == 3


def test_a_reorder_at_configure_is_seen():
    calls: list[str] = []
    one, two = Recorder("one", calls), Recorder("two", calls)
    parent = Parent(calls, [one, two])
    parent.request = None  # type: ignore[assignment]  # only the children handle the event
    with taddons.context(parent) as tctx:
        table = HookTable(tctx.master.addons)
        table.install()
        _trigger(tctx)
        parent.addons = [two, one]  # what ScriptLoader.configure does when the scripts option changes
        tctx.options.update(listen_host="127.0.0.2")  # a configure event
        _trigger(tctx)
    assert calls == ["one", "two", "two", "one"]


def test_installed_on_the_manager_and_removed_again():
    calls: list[str] = []
    with taddons.context(Recorder("a", calls)) as tctx:
        m = tctx.master.addons
        table = HookTable(m)
        table.install()
        assert m.trigger_event == table.trigger_event
        _trigger(tctx)  # through the manager: the table answers
        assert table.builds == 1
        table.uninstall()
        assert "trigger_event" not in vars(m)
        _trigger(tctx)
        assert calls == ["a", "a"] and table.builds == 1


@pytest.mark.parametrize("bad", [42, "not callable"])
def test_a_handler_that_is_not_callable_is_reported_as_mitmproxy_does(caplog, bad):
    class Odd:
        request = bad
    calls: list[str] = []
    with taddons.context(Odd(), Recorder("b", calls)) as tctx:
        table = HookTable(tctx.master.addons)
        table.install()
        with caplog.at_level(logging.ERROR):
            _trigger(tctx)
    assert calls == ["b"]
    assert any("Addon handler request" in r.getMessage() for r in caplog.records)  # mitmproxy's own words
