"""A capturing proxy for a test module: one ``ProxyProcess`` in exact-history mode, writing its
captures, mitmproxy conf dir and log under a directory the caller owns, stopped on exit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def capturing_proxy(upstream_url: str, root: Path, served_model: str, **options: Any) -> Iterator[tuple[Path, Any]]:
    """Yield ``(captures_dir, proxy)``; ``options`` are ``polar_*`` options added to exact history."""
    from polar_proxy.process import ProxyProcess

    px = ProxyProcess(upstream_url, root / "captures", confdir=root / "mitmproxy", served_model=served_model,
                      log_file=root / "proxy.log", options={"polar_exact_history": True, **options}).start()
    try:
        yield root / "captures", px
    finally:
        px.stop()
