"""The pause gate: new model calls wait here while the trainer swaps the served weights.

Closed by ``polar_pause``, the ``polar.pause`` command or ``POST /_polar/pause``; a paused proxy
still finishes the calls in flight, and ``drain`` waits until they are done (the trainer then
reloads vLLM, which must not serve a call half with old and half with new weights).
"""

from __future__ import annotations

import asyncio


class PauseGate:
    """Open or closed; calls wait while it is closed, ``drain`` waits for the calls in flight."""

    def __init__(self) -> None:
        self._open = asyncio.Event()  # set = not paused
        self._open.set()
        self._drained = asyncio.Event()  # set = no call in flight
        self._drained.set()
        self.waiting = 0  # calls held at the gate now

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def set_paused(self, paused: bool) -> None:
        if paused:
            self._open.clear()
        else:
            self._open.set()

    async def wait_open(self, timeout: float) -> bool:
        """Pass at once when open; else wait (at most ``timeout`` seconds, 0: no limit). False: timed out."""
        if self._open.is_set():
            return True
        self.waiting += 1
        try:
            if timeout > 0:
                await asyncio.wait_for(self._open.wait(), timeout)
            else:
                await self._open.wait()
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.waiting -= 1

    def call_started(self) -> None:
        self._drained.clear()

    def all_calls_done(self) -> None:
        self._drained.set()

    async def drain(self, in_flight: int, timeout: float) -> bool:
        """Wait until no model call is in flight (``in_flight``: how many are now)."""
        if not in_flight:
            return True
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
