"""The sandbox under test, shared by the adversarial tests: bubblewrap, or the backend named by
POLAR_SANDBOX_UNDER_TEST (``host`` shows what the sandbox prevents: the attacks then succeed).
POLAR_SANDBOX_UNHARDENED=1 runs bubblewrap as it was before the root hardening."""

from __future__ import annotations

import os

import pytest

from polar_runtime.sandbox import SandboxUnavailable, get_sandbox

BACKEND = os.environ.get("POLAR_SANDBOX_UNDER_TEST", "bubblewrap")


@pytest.fixture(scope="module")
def sandbox():
    try:
        return get_sandbox(BACKEND)
    except SandboxUnavailable as e:
        pytest.skip(str(e))
