"""A minimal Harbor task on disk and a rollout row's post-mortem, for the live-trial tests of every
container backend (docker, podman): the same task, whichever runtime runs it."""

from __future__ import annotations

import textwrap
from pathlib import Path


def harbor_task(root: Path, name: str, solve: str, test: str, *, base: str = "debian:bookworm",
                toml: str = "") -> Path:
    """``root/name``: task.toml (verifier 60 s, agent 120 s, plus ``toml``), a Dockerfile ``FROM
    base`` with WORKDIR /app, ``solution/solve.sh`` and ``tests/test.sh`` (bash, dedented)."""
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "tests").mkdir()
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n[agent]\ntimeout_sec = 120\n' + toml)
    (d / "instruction.md").write_text("Do the thing.\n")
    (d / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\n")
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + textwrap.dedent(test))
    return d


def why(rows: list[dict]) -> str:
    """Each row's reward, verdict, error, the verifier's output's tail and the sandbox's notes."""
    return "\n".join(f"{r['reward']} {r['evaluator_status']} {r['error']}\n{r['evaluator_output'][-800:]}\n"
                     f"{r['sandbox_notes']}" for r in rows)
