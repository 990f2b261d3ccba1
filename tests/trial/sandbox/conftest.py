"""The sandbox under test, shared by the adversarial tests: bubblewrap, or the backend named by
POLAR_SANDBOX_UNDER_TEST (``host`` shows what the sandbox prevents: the attacks then succeed).
POLAR_SANDBOX_UNHARDENED=1 runs bubblewrap as it was before the root hardening."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from polar_trial.sandbox import SandboxUnavailable, get_sandbox

BACKEND = os.environ.get("POLAR_SANDBOX_UNDER_TEST", "bubblewrap")


@pytest.fixture(scope="module")
def sandbox():
    try:
        return get_sandbox(BACKEND)
    except SandboxUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def dockerd():
    """One private daemon for the whole test session (never the machine's own, if it has one):
    ``--userns-remap`` and no container log, as ``polar docker start`` runs it; always stopped.
    Starting one costs ~8 s and stopping it 5-16 s, so every docker test module shares it."""
    from polar_trial.sandbox.docker import DockerSandbox
    from polar_trial.sandbox.dockerd import PrivateDockerd

    if os.getuid() != 0:
        pytest.skip("a private dockerd needs root (the CI machines run as root)")
    root = Path(tempfile.mkdtemp(prefix="pd-", dir="/tmp"))  # short: containerd's socket path
    d = PrivateDockerd(root)
    old = os.environ.get("DOCKER_HOST")
    try:
        d.start(timeout_s=120)
        os.environ["DOCKER_HOST"] = d.host
        DockerSandbox._images.clear()  # images looked up on another daemon do not count here
        yield d
    finally:
        if old is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = old
        DockerSandbox._images.clear()
        d.stop()
        assert d.pid() is None
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def podman_store():
    """One podman store of our own for the whole test session (``podmanroot.py``: btrfs on a loop
    image, runc, no container log, ``--userns=auto`` ranges), never the host's
    /var/lib/containers; its containers removed and it unmounted at the end. Skips without root or
    podman (scripts/setup.sh installs it)."""
    from polar_trial.sandbox.podman import PodmanSandbox
    from polar_trial.sandbox.podmanroot import PodmanRoot

    if os.getuid() != 0:
        pytest.skip("polar's podman store needs root (the CI machines run as root)")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/setup.sh installs it)")
    root = Path(tempfile.mkdtemp(prefix="pp-", dir="/tmp"))
    store = PodmanRoot(root, data_quota_gb=8)
    old = {k: os.environ.get(k) for k in store.env()}
    try:
        store.start(install=False)
        store.use()
        PodmanSandbox._images.clear()
        yield store
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        PodmanSandbox._images.clear()
        store.stop()
        assert not store.mounted()
        shutil.rmtree(root, ignore_errors=True)
