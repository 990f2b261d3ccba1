"""The agent phase's own memory limit inside a live trial's one container (``phasecgroup.py``: a
memory sub-cgroup made from the host, cgroup v1), live on the session's private dockerd
(``conftest.dockerd``). The trial is configured as ``open_live_trial`` does: the container holds
the agent's limit plus the verifier's room (``verifier_memory_mb``: as much again), the agent phase
its own limit. Scaled down to 64 MiB + 64 MiB.

The first two were watched failing with the sub-cgroup taken away (``phase_memory_mb`` empty, the
container still at 128 MiB): the agent's 100 MiB then fit and was not killed, and the leftover's
holders filled the container until the OOM killer ended its PID 1 (our init), so the verifier
could not even be started. The third was watched failing with ``OOM_SCORE_ADJ`` 0. Times (2-core
machine, load ~8, the session's daemon up): each 4-7 s, the three ~20 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.docker

AGENT_MB = 64
#: a process that holds N MiB of anonymous memory for S seconds: tail buffers a pipe with no
#: newline whole (coreutils keeps every buffer until it has seen 10 lines), so no Python is needed
HOLD = "{{ head -c {mb}M /dev/zero; sleep {s}; }} | tail > /dev/null"


def _trial(work: Path):
    from polar_trial.sandbox import phasecgroup
    from polar_trial.sandbox.docker import DockerSandbox
    from polar_trial.sandbox.trial import LiveTrial, TrialConfig

    if not phasecgroup.available("memory"):
        pytest.skip("no cgroup v1 memory hierarchy on this host (per-phase memory is built for v1)")
    room = phasecgroup.verifier_memory_mb(AGENT_MB, None)
    return LiveTrial(DockerSandbox(), TrialConfig(image="debian:bookworm", workdir_host=work, pids=512,
                                                  memory_mb=AGENT_MB + room, phase_memory_mb={"agent": AGENT_MB}))


def _spec(work: Path):
    from polar_trial.sandbox import SandboxSpec

    return SandboxSpec(workdir_host=work, env={"PATH": "/usr/bin:/bin"}, timeout_s=60)


def test_an_agent_that_fills_memory_is_killed_at_its_own_limit_and_the_verifier_scores(dockerd, tmp_path):
    """The agent allocates 100 MiB: under the container's 128 MiB it would fit; at its own 64 it is
    OOM-killed, said as the phase's "memory limit hit" (what the verdict and ``polar tasks check``
    read). The verifier then holds 40 MiB and writes its reward."""
    work = tmp_path / "w"
    with _trial(work) as trial:
        agent = trial.view("agent").run(_spec(work), ["sh", "-c", HOLD.format(mb=100, s=0)])
        assert agent.returncode != 0, agent
        hit = [n for n in agent.notes if n.startswith("memory limit hit")]
        assert hit and f"at its own {AGENT_MB} MiB" in hit[0], agent.notes
        assert any(f"own memory limit: {AGENT_MB} MiB" in n for n in agent.notes), agent.notes
        sub = next(c for c in trial._cgroups if (c / "memory.oom_control").is_file())  # the host's view
        for f in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):  # no swap beyond it either
            if (sub / f).exists() or f == "memory.limit_in_bytes":
                assert int((sub / f).read_text()) == AGENT_MB << 20, f
        verifier = trial.view("verifier").run(_spec(work), ["sh", "-c", HOLD.format(mb=40, s=1) +
                                                            f" && echo 1 > {trial.cfg.workdir}/reward.txt"])
        assert verifier.returncode == 0, verifier
        assert (work / "reward.txt").read_text().strip() == "1"
        assert not any(n.startswith("memory limit hit") for n in verifier.notes), verifier.notes


def test_a_leftover_that_keeps_allocating_cannot_starve_the_verifier(dockerd, tmp_path):
    """The agent leaves a loop that starts an 8 MiB holder every 0.1 s, forever: many small
    processes, so the OOM killer, which takes the largest, never picks them over the verifier's
    40 MiB. Held in the agent's own sub-cgroup, they cycle there (killed at 64 MiB, started again)
    while the verifier holds its 40 MiB and scores; the kills are said as the agent's leftovers'."""
    import time

    work = tmp_path / "w"
    leftover = ("setsid sh -c 'while :; do (" + HOLD.format(mb=8, s=600) + ") & sleep 0.1; done' "
                "</dev/null >/dev/null 2>&1 &")
    with _trial(work) as trial:
        agent = trial.view("agent").run(_spec(work), ["sh", "-c", leftover])
        assert agent.returncode == 0, agent
        time.sleep(1.5)  # the leftovers at the agent's limit (or, without it, filling the container)
        verifier = trial.view("verifier").run(_spec(work), ["sh", "-c", HOLD.format(mb=40, s=2) +
                                                            f" && echo 1 > {trial.cfg.workdir}/reward.txt"])
        assert verifier.returncode == 0, verifier
        assert (work / "reward.txt").read_text().strip() == "1"
        assert any("process(es) the agent phase left running" in n for n in verifier.notes), verifier.notes



def test_the_oom_killer_takes_the_agents_processes_before_its_init(dockerd, tmp_path):
    """An agent of many small processes at its limit (30 holders of 6 MiB, started every 0.05 s,
    then ``echo done``): the OOM killer takes holders, and the phase's own command still ends 0.
    Our init is in the sub-cgroup too, with 13 MB resident charged to the container's (it joined
    after its start-up), so killing it frees nothing there; without ``OOM_SCORE_ADJ`` on the
    phase's processes it was the first victim and the phase returned 137 (watched)."""
    work = tmp_path / "w"
    many = "for i in $(seq 1 30); do (" + HOLD.format(mb=6, s=600) + ") & sleep 0.05; done; sleep 1; echo done"
    with _trial(work) as trial:
        agent = trial.view("agent").run(_spec(work), ["sh", "-c", many])
        assert agent.returncode == 0, agent
        assert any(n.startswith("memory limit hit") for n in agent.notes), agent.notes
