"""Helpers for the debugging notebooks (notebooks/*.ipynb) that are not analysis.

A run where no model call was captured (the harness could not start, the proxy was never reached)
is a normal thing to open: the notebooks then say so in one line instead of raising a traceback in
every cell. IPython cannot stop a notebook half-way without an error, so the later cells are turned
into no-ops by an input transformer, which removes itself when a cell sets ``RUN_DIR`` again (the
reader points the notebook at another run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

EMPTY_MESSAGE = "no calls captured in {run}"


def count_calls(capture: Path) -> int:
    """Model calls recorded under ``capture`` (a capture directory, or a run directory holding
    ``captures/``); 0 when there is nothing there."""
    import polars as pl

    from polar_analysis import frames

    capture = Path(capture)
    if capture.is_file():  # a saved mitmproxy flow file
        return frames.flows_calls(capture).height
    if not capture.is_dir():
        return 0
    return int(frames.calls(capture, rewards=None).select(pl.len()).collect().item())


def _ipython() -> Any | None:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def skip_rest_if_no_calls(capture: Path, run: Path | None = None) -> bool:
    """True (and the later cells do nothing) when ``capture`` holds no model call; prints
    ``no calls captured in RUN``. False otherwise, and the notebook goes on."""
    if count_calls(capture):
        return False
    print(EMPTY_MESSAGE.format(run=run or capture))
    ip = _ipython()
    if ip is not None:
        transformers: list[Callable[[list[str]], list[str]]] = ip.input_transformers_post
        transformers[:] = [t for t in transformers if getattr(t, "__name__", "") != "_polar_skip_cell"]

        def _polar_skip_cell(lines: list[str]) -> list[str]:
            if any("RUN_DIR" in line for line in lines):  # the reader starts over, maybe with another run
                transformers.remove(_polar_skip_cell)
                return lines
            return ["pass\n"]

        transformers.append(_polar_skip_cell)
    return True
