"""mitmproxy's event dispatch, with each event's handlers looked up once instead of on every event.

Why: ``AddonManager.trigger_event`` walks the whole addon chain for every event (mitmdump's 31
default addons, the dumper, the script loader and its scripts): for each addon it enters
``safecall()`` (a ``contextlib`` generator), creates an ``invoke_addon`` coroutine, walks the
addon's sub-addons with a generator and ``getattr``s the hook's name, and calls ``Hook.args()``
(``dataclasses.fields``) once per handler. ``handle_lifecycle`` does it twice per flow event (the
event, then ``update``). A model call has 6-9 such events, nearly all of them handled by 1-3
addons, so most of that walk finds nothing: py-spy of the proxy at 64 sessions
(``benchmarks/guard_proxy_cpu.py --profile``, issue 42) put ~20% of the proxy's CPU in
``trigger_event``, ``_iter_hooks``, ``traverse`` and ``contextlib``.

:class:`HookTable` replaces the manager's ``trigger_event`` (on this manager instance only) with one
that keeps, per event name, the chain entries that handle it and their handlers, in chain order,
each entry inside its own ``safecall()`` as before, so an addon's error is logged and the next
addon still runs, and ``AddonHalt`` still stops the event. The table is rebuilt whenever the chain
can have changed: ``register``, ``remove``, ``add``, ``clear`` (scripts load and reload through
these) and after every ``configure`` (the script loader can reorder its scripts there). An event
whose lookup fails (a handler that is not callable) is dispatched the original way, which logs the
error as mitmproxy does.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

from mitmproxy import addonmanager, exceptions, hooks

#: (chain entry, its handlers of one event, in traversal order)
Entry = tuple[Any, tuple[Callable[..., Any], ...]]


class HookTable:
    """Per-event handler lists for one ``AddonManager``; :meth:`install` puts it in place."""

    def __init__(self, manager: addonmanager.AddonManager):
        self.manager = manager
        self.table: dict[str, tuple[Entry, ...] | None] = {}
        self._originals: dict[str, Any] = {}
        self.builds = 0  # how many times an event's entries were looked up (tests, status)

    # -- installation ------------------------------------------------------------------------
    def install(self) -> None:
        m = self.manager
        if "trigger_event" in vars(m):
            return  # installed already (a second Polar instance, or a script reload)
        for name in ("trigger_event", "trigger", "register", "remove", "add", "clear"):
            self._originals[name] = getattr(m, name)
        m.trigger_event = self.trigger_event  # type: ignore[method-assign]
        m.trigger = self._trigger  # type: ignore[method-assign]
        for name in ("register", "remove", "add", "clear"):
            setattr(m, name, self._invalidating(self._originals[name]))

    def uninstall(self) -> None:
        for name in self._originals:
            self.manager.__dict__.pop(name, None)
        self._originals.clear()
        self.table.clear()

    def invalidate(self) -> None:
        self.table.clear()

    def _invalidating(self, func: Callable[..., Any]) -> Callable[..., Any]:
        def changed(*args: Any, **kwargs: Any) -> Any:
            self.table.clear()
            try:
                return func(*args, **kwargs)
            finally:
                self.table.clear()
        return changed

    def _trigger(self, event: hooks.Hook) -> None:
        self._originals["trigger"](event)
        if isinstance(event, addonmanager.hooks.ConfigureHook):
            self.table.clear()

    # -- dispatch ----------------------------------------------------------------------------
    def entries(self, event: hooks.Hook) -> tuple[Entry, ...] | None:
        """The chain entries handling ``event`` (None: look them up the original way)."""
        name = event.name
        try:
            return self.table[name]
        except KeyError:
            pass
        self.builds += 1
        found: list[Entry] = []
        try:
            for entry in self.manager.chain:
                funcs = []
                for a in addonmanager.traverse([entry]):
                    func = getattr(a, name, None)
                    if func is None or isinstance(func, types.ModuleType):
                        continue  # "from mitmproxy import log" in a script is not a handler
                    if not callable(func):
                        raise exceptions.AddonManagerError(f"Addon handler {name} ({a}) not callable")
                    funcs.append(func)
                if funcs:
                    found.append((entry, tuple(funcs)))
        except exceptions.AddonManagerError:
            self.table[name] = None
            return None
        result = self.table[name] = tuple(found)
        return result

    async def trigger_event(self, event: hooks.Hook) -> None:
        entries = self.entries(event)
        if entries is None:
            return await self._originals["trigger_event"](event)
        if not entries:
            return
        args = event.args()
        for _entry, funcs in entries:
            try:
                with addonmanager.safecall():
                    for func in funcs:
                        res = func(*args)
                        if res is not None and inspect.isawaitable(res):
                            await res
            except exceptions.AddonHalt:
                return
