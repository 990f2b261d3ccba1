"""The trainer's heap policy: freed large buffers leave the process (glibc keeps them otherwise)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from polar_training import heap

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from polar_training.heap import map_large_allocations

    def anon_mib():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024

    if sys.argv[1] == "mapped":
        assert map_large_allocations()
    first = torch.ones(8 << 20, dtype=torch.uint8)
    del first  # a freed mapped block raises glibc's dynamic threshold past 8 MiB
    base = anon_mib()
    big, small = [], []
    for _ in range(100):  # 2 MiB activations between small survivors, as in a backward pass
        big.append(torch.ones(2 << 20, dtype=torch.uint8))
        small.append(torch.ones(2048))
    held = anon_mib()
    del big
    print(held - base, anon_mib() - base)
    """
)


def _run(mode: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    held, after = map(float, out.stdout.split())
    return held, after


@pytest.mark.skipif(heap._libc() is None or not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_large_buffers_are_returned_only_with_large_allocations_mapped():
    held, kept = _run("default")
    assert held > 150 and kept > 150  # glibc's default: 200 MiB freed, still resident
    held, returned = _run("mapped")
    assert held > 150 and returned < 20

