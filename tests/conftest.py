"""Shared fixtures: offline models (built once, reused across sessions) and real vLLM servers.

Servers are session-scoped: each starts once per pytest run on a free loopback port and is
stopped (whole process group) at the end. To develop against already running servers instead,
set POLAR_TEST_VLLM_TINY_URL / POLAR_TEST_VLLM_QWEN05_URL (e.g. the shared dev servers listed
in /tmp/polar-dev/servers.json); CI leaves them unset and starts its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from polar_runtime import models
from polar_runtime.serve import VLLMServer

_JUPYTER_VARS = {
    "JUPYTER_CONFIG_DIR": "config",
    "JUPYTER_DATA_DIR": "data",
    "JUPYTER_RUNTIME_DIR": "runtime",
    "IPYTHONDIR": "ipython",
}
_jupyter_root: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Notebook tests must never read or write ~/.jupyter or ~/.ipython."""
    global _jupyter_root
    _jupyter_root = tempfile.mkdtemp(prefix="polar-test-jupyter-")
    for var, sub in _JUPYTER_VARS.items():
        path = Path(_jupyter_root) / sub
        path.mkdir()
        os.environ[var] = str(path)
    os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    if _jupyter_root:
        shutil.rmtree(_jupyter_root, ignore_errors=True)
    if os.geteuid() == 0:  # disk images of the polar processes tests killed mid-phase (kill -9 tests)
        from polar_trial.sandbox.loopdev import janitor

        janitor()


@pytest.fixture(scope="session")
def tiny_qwen_dir() -> Path:
    """2-layer random Qwen2 with the real Qwen2.5 tokenizer and chat template (builds if missing)."""
    return models.ensure_model(models.TINY_QWEN)


@pytest.fixture(scope="session")
def qwen05_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, bf16 safetensors converted from the packaged GGUF."""
    return models.ensure_model(models.QWEN05)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """SmolLM2-135M-Instruct (ChatML template without tools)."""
    return models.ensure_model(models.SMOLLM)


def _server(name: str, env_var: str, **kwargs):
    url = os.environ.get(env_var)
    if url:
        yield VLLMServer.attach(url, models.ensure_model(name), served_model_name=name)
        return
    models.ensure_model(name)
    server = VLLMServer(name, served_model_name=name, **kwargs)
    try:
        server.start(wait=True)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_tiny():
    """A running vLLM serving tiny-qwen (served name "tiny-qwen"), started once per session."""
    yield from _server(models.TINY_QWEN, "POLAR_TEST_VLLM_TINY_URL", max_model_len=32768)


@pytest.fixture(scope="session")
def vllm_qwen05():
    """A running vLLM serving the 0.5B (served name "qwen2.5-coder-0.5b-instruct")."""
    yield from _server(models.QWEN05, "POLAR_TEST_VLLM_QWEN05_URL", max_model_len=32768)


@pytest.fixture
def ctrl_c():
    """Python's own Ctrl-C handler for a test that sends itself SIGINT, whatever the test run was
    started with: a process started in the background by a non-interactive shell inherits SIGINT
    ignored, and no KeyboardInterrupt ever comes (the rollout's two Ctrl-C tests failed so, launched
    with ``bash -c '...' &``)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
