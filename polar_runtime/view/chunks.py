"""The report directory: the page, its script and style, the vendored plotting library, and the
data as JavaScript chunks (``data/run.js``, ``data/samples/<i>.js``) that call ``polarData(name,
value)``. Loaded by ``<script src>`` tags, they work from ``file://`` (where ``fetch`` of a local
file is refused) and under the page's content security policy (``script-src 'self'``, no inline
script, no eval: Chromium 156 loads file-relative scripts under it, measured).

Everything in the data came from the policy or the task, so the JSON is made safe to embed in a
script: ``<``, ``>``, ``&``, U+2028 and U+2029 are written as ``\\uXXXX`` escapes (in JSON they can
only occur inside strings, where the escape means the same character), so a ``</script>`` or an
``<!--`` in a model's answer is inert even if the chunk were ever inlined into HTML; NaN and
infinities become null. The page builds its DOM with ``textContent`` only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).parent
STATIC = HERE / "static"
VENDOR = HERE / "vendor"
ASSETS = ("index.html", "app.js", "style.css")

_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def js_literal(value: Any) -> str:
    """``value`` as JSON that is also safe inside a ``<script>``: see the module docstring. orjson
    writes NaN and infinities as null, and is fast: the 1,000-sample benchmark run's chunks took
    131 s with a Python pass that replaced NaN before ``json.dumps``."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:  # an integer beyond 64 bits (a harness's seed in a request)
        from .summary import clean

        text = json.dumps(clean(value), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.translate(_ESCAPES)


def chunk(name: str, value: Any) -> bytes:
    """A data chunk: one call of the page's ``polarData``."""
    return f"polarData({js_literal(name)},{js_literal(value)});\n".encode()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def copy_assets(out: Path) -> None:
    """The page, script, style and the vendored library (with its licence)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ASSETS:
        shutil.copyfile(STATIC / name, out / name)
    shutil.copytree(VENDOR, out / "vendor", dirs_exist_ok=True)


def write_report(view: Any, out: str | os.PathLike, samples: bool = True) -> Path:
    """Write the report of ``view`` (a :class:`RunView`) into ``out``; returns ``out/index.html``."""
    out = Path(out)
    copy_assets(out)
    view.refresh()
    _write(out / "data" / "run.js", chunk("run", view.summary))
    if samples:
        for i in range(len(view.sample_ids)):
            _write(out / "data" / "samples" / f"{i}.js", chunk(f"sample/{i}", view.sample(i)))
    return out / "index.html"
