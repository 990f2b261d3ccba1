"""How a rollout's live trial splits its limits between the agent phase and the verifier
(``phases.open_live_trial``, ``sandbox/phasecgroup.py``), without a daemon; the live tests are in
``test_phase_memory.py`` (memory) and ``test_trial_live.py`` (pids)."""

from __future__ import annotations


def test_a_rollouts_trial_gives_the_agent_the_tasks_memory_and_the_container_the_verifiers_room(monkeypatch, tmp_path):
    """``open_live_trial``'s wiring, no daemon: the agent phase's own limit is the task's
    ``memory_mb``; the container's is that plus the verifier's room (as much again, never past the
    host's memory); on a host without a v1 memory hierarchy (a cgroup v2 host), the task's limit
    alone, and every phase's notes say the agent's leftovers share the trial's limits."""
    import contextlib

    from polar_trial import phases
    from polar_trial.sandbox import phasecgroup
    from polar_trial.tasks import model
    from polar_trial.tasks.model import Task

    class Docker:
        name, runtime, host_init = "docker", "docker", True

    assert phasecgroup.verifier_memory_mb(2048, 24000) == 2048
    assert phasecgroup.verifier_memory_mb(16384, 24000) == 24000 - 16384
    assert phasecgroup.verifier_memory_mb(24000, 24000) == 0
    monkeypatch.setattr(model, "host_memory_mb", lambda: 24000)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    monkeypatch.setattr(phasecgroup, "UNIFIED", tmp_path / "cgroup.controllers")
    for v1, want in ((True, (4096, {"agent": 2048})), (False, (2048, {}))):
        monkeypatch.setattr(phasecgroup, "available", lambda controller="pids", v1=v1: v1)
        with contextlib.ExitStack() as stack:
            trial = phases.open_live_trial(Task(id="t", instruction="-", memory_mb=2048), Docker(), "img:1",
                                           tmp_path / "w", stack, pids=None, builds=tmp_path / "b")
            assert (trial.cfg.memory_mb, trial.cfg.phase_memory_mb) == want
            shared = [n for n in trial.notes if "share the trial's limits" in n]
            # a v2 host: said in every phase's notes, for pids and memory
            assert (shared == []) if v1 else ("pids: a cgroup v2 host" in shared[0] and "memory: a cgroup v2 host"
                                              in shared[0]), trial.notes
