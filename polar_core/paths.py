"""Where Polar keeps what it builds: one cache root, overridable with POLAR_HOME.

The cache lives outside the checkout so every clone (and CI) reuses venvs, models and harnesses.
Only locations live here (and ``model_dir_for``, which finds a built model by name); building
them is the runtime's job (``polar_runtime.models``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute against the current directory, ``~`` expanded, once, at a boundary.

    Every path that leaves this process (a child's cwd, ``HOME``, ``CODEX_HOME``, a config file
    written for a harness, a capture dir handed to mitmdump) must be absolute: the child resolves a
    relative path against *its own* cwd. The README's ``polar demo`` (default ``runs/demo``) failed
    that way: Pi, started in its work dir, looked for its config under ``work/runs/demo/...``."""
    return Path(path).expanduser().resolve()


def polar_home() -> Path:
    return absolute(os.environ.get("POLAR_HOME") or Path.home() / ".cache" / "polar")


def models_dir() -> Path:
    return polar_home() / "models"


def model_dir_for(name: str | None) -> Path | None:
    """A built model directory for a served/requested model name (or a path), if there is one."""
    if not name:
        return None
    p = Path(name).expanduser()
    if p.is_dir() and (p / "tokenizer_config.json").exists():
        return p
    candidates = [models_dir() / name, models_dir() / name.rsplit("/", 1)[-1], models_dir() / name.lower().rsplit("/", 1)[-1]]
    return next((c for c in candidates if (c / "tokenizer_config.json").exists()), None)


def harnesses_dir() -> Path:
    return polar_home() / "harnesses"


def mitmproxy_confdir() -> Path:
    return polar_home() / "mitmproxy"


def vllm_cache_dir() -> Path:
    return polar_home() / "vllm-cache"


def tiktoken_cache_dir() -> Path:
    return polar_home() / "tiktoken"


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")


def vllm_python() -> Path:
    """Python of the inference-server venv made by scripts/setup.sh."""
    kind = "gpu" if has_gpu() else "cpu"
    return polar_home() / "venvs" / f"vllm-{kind}" / "bin" / "python"


def harness_request_fixtures() -> Path:
    """Real first/second requests of the harnesses (fake keys), used by tests and benchmarks.

    A copy is committed under tests/fixtures/; a shared/ folder inside or beside the checkout
    (where the project's recordings are kept) is used when the copy is absent.
    """
    candidates = (
        REPO_ROOT / "tests" / "fixtures" / "harness-requests",
        REPO_ROOT / "shared" / "fixtures" / "harness-requests",
        REPO_ROOT.parent / "shared" / "fixtures" / "harness-requests",
    )
    return next((d for d in candidates if d.is_dir()), candidates[0])
