"""A phase's own pids and memory limits inside a live trial's one container: sub-cgroups made from the host.

The container's ``--pids-limit`` and ``--memory`` are the trial's, shared by every phase and by what
a phase leaves running, so an agent's fork bomb or a leftover that keeps allocating could take every
pid or byte the verifier needs. Inside the container the cgroup files are read-only, so the host
makes ``<container's cgroup>/polar-<phase>`` in each controller's hierarchy with the phase's limit,
hands its ``cgroup.procs`` to the container's (remapped) root, and binds the dir into the trial's
dir; the phase's init writes itself into it before it starts the phase, so the phase and everything
it leaves are counted there, under the trial's limit too.

Built for cgroup v1 (this machine: the private dockerd's containers under
``/sys/fs/cgroup/{pids,memory}/docker/<id>/``). What the kernel here does with a memory sub-cgroup
(6.18, measured): a process in it is OOM-killed at its ``memory.limit_in_bytes`` while its parent
has room; the kill is counted in the sub-cgroup's ``memory.oom_control`` only, not in its parent's
(v1 events do not propagate up), so :func:`oom_kills` reads it there; kernel memory (dentries,
inodes: 25,000 empty files on a tmpfs held 24 MB of it) is charged to ``memory.limit_in_bytes``,
and ``memory.kmem.limit_in_bytes`` takes a write but keeps reading "unlimited" (the kernel dropped
kmem limits), so none is set; swap accounting is on (``memory.memsw.*`` exist), so
``memory.memsw.limit_in_bytes`` gets the same value: no swap beyond the limit, as ``--memory-swap``
does for the container.

On cgroup v2 a cgroup with children may hold no process of its own, and ``docker exec`` puts each
new process in the container's top cgroup: there the phase runs without limits of its own
(``container_cgroup`` answers None; a rollout's trial asks for none there, and every phase's notes
say the trial's limits are shared: :func:`shared_note`). Making it would mean moving the container's init
and every exec into a leaf (runc falls back to the init's cgroup when joining the top one fails
with EBUSY) and delegating the container's ``cgroup.procs``; not built, as this machine has no v2
memory or pids controller to test it on (both are bound to v1 hierarchies).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


#: pids a live trial's container gets beyond the agent's own limit (``polar_trial/phases.py``): the
#: verifier's, which no leftover of the agent can take (a TB2 verifier with uv and pytest: < 20)
VERIFIER_PIDS = 256
#: the ``oom_score_adj`` of a phase's processes where the phase has a memory sub-cgroup of its own
#: (set by its init's child before the command, inherited): the OOM killer then takes them before
#: our init, which is in the sub-cgroup too but whose memory is charged to the container's (made
#: before it joined), so killing it frees nothing there. Measured without it: the init (13 MB
#: resident, the host's Python) was the first victim among 6 MB holders, and a phase whose command
#: exited 0 returned 137. The bonus is this/1000 of the limit, the same for every process of the
#: phase, so which of them goes first is unchanged; past 26 MiB of limit it outweighs the init's
#: 13 MB. An agent may lower it back to 0 (not below: no CAP_SYS_RESOURCE), only against itself.
#: In the container's (and the host's) OOM its leftovers go before the verifier too.
OOM_SCORE_ADJ = 500
#: present where /sys/fs/cgroup is the cgroup v2 (unified) hierarchy
UNIFIED = Path("/sys/fs/cgroup/cgroup.controllers")


def verifier_memory_mb(agent_mb: int, host_mb: int | None) -> int:
    """The memory a live trial's container gets beyond the agent's own limit: the verifier's,
    which no leftover of the agent can take. The task's ``memory_mb`` again: a verifier's own
    tools are small (uv and pytest), but its tests run the sample's program on their inputs, which
    the task sized at ``memory_mb`` (Harbor's verifier has that limit, less what the agent left);
    never past the host's memory (a container limit above it would leave the host's OOM killer,
    which on a shared machine ends other users' processes, to act instead)."""
    room = agent_mb if host_mb is None else min(agent_mb, host_mb - agent_mb)
    return max(room, 0)


def available(controller: str = "pids") -> bool:
    """Whether this host has a cgroup v1 hierarchy of ``controller`` (where a phase's own limit
    can be made)."""
    try:
        return _mount_of(controller) is not None
    except OSError:
        return False


def shared_note(pids_own: bool, memory_room_mb: int) -> str | None:
    """The note every phase of a live trial carries where the agent's pids or memory cannot be its
    own on this host (the trial's limit then holds for every phase, the verifier's included), or
    None where both are."""
    why = []
    for controller, ok in (("pids", pids_own), ("memory", memory_room_mb > 0)):
        if ok:
            continue
        if available(controller):  # memory: the task asks for all of this host's
            why.append(f"{controller}: the task's limit is this host's memory, no room for the verifier's own")
        elif UNIFIED.exists():
            why.append(f"{controller}: a cgroup v2 host (a phase's own limits are built for cgroup v1 only)")
        else:
            why.append(f"{controller}: no cgroup v1 {controller} hierarchy on this host")
    if not why:
        return None
    return ("the agent's leftovers share the trial's limits with the verifier, no sub-cgroup of their own ("
            + "; ".join(why) + ")")


def _mount_of(controller: str) -> Path | None:
    """Where this host mounts the cgroup v1 hierarchy of ``controller``."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        t = tail.split()
        if len(t) >= 3 and t[0] == "cgroup" and controller in t[2].split(","):
            return Path(head.split()[4])
    return None


def container_cgroup(runtime: str, name: str, controller: str = "pids") -> Path | None:
    """The host's dir of container ``name``'s ``controller`` cgroup (v1), or None."""
    r = subprocess.run([runtime, "inspect", "--format", "{{.State.Pid}}", name], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    pid = int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0
    if pid <= 0:
        return None
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            root = _mount_of(controller)
            d = root / path.lstrip("/") if root is not None else None
            return d if d is not None and d.is_dir() else None
    return None


def limit_files(controller: str, value: int, sub: Path | None = None) -> dict[str, str]:
    """The files that set a phase's limit of ``controller`` (``pids``: a count; ``memory``: MiB),
    in the order to write them (memsw may not go below the memory limit, so memory first)."""
    if controller == "pids":
        return {"pids.max": str(int(value))}
    if controller == "memory":
        n = str(int(value) << 20)
        files = {"memory.limit_in_bytes": n}
        if sub is None or (sub / "memory.memsw.limit_in_bytes").exists():  # swap accounting on
            files["memory.memsw.limit_in_bytes"] = n
        return files
    raise ValueError(f"no phase limit of controller {controller!r}")


def make(base: Path, name: str, controller: str, value: int, owner: int | None) -> Path:
    """``base/name`` with the phase's limit of ``controller`` (:func:`limit_files`); its
    ``cgroup.procs`` writable by ``owner`` (the container's root on the host), so the phase's init
    can move itself in. Removed again if a limit cannot be written (no phase runs unlimited in it)."""
    sub = base / name
    sub.mkdir()
    try:
        for f, v in limit_files(controller, value, sub).items():
            (sub / f).write_text(v)
        if owner is not None:
            os.chown(sub / "cgroup.procs", owner, owner)
    except OSError:
        remove(sub)
        raise
    return sub


def oom_kills(sub: Path) -> int | None:
    """The OOM killer's kills in memory sub-cgroup ``sub`` (v1 ``memory.oom_control``: its own
    only), None where it cannot be read. A file of the host's cgroupfs, never the container's."""
    try:
        for line in (sub / "memory.oom_control").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill" and v.strip().isdigit():
                return int(v)
    except OSError:
        pass
    return None


def score_adj(subs: list[Path], phase: str) -> int:
    """:data:`OOM_SCORE_ADJ` for ``phase`` where one of ``subs`` is its own memory sub-cgroup, else 0."""
    own = any(c.name == f"polar-{phase}" and (c / "memory.oom_control").is_file() for c in subs)
    return OOM_SCORE_ADJ if own else 0


def oom_snapshot(subs: list[Path]) -> dict[Path, int | None]:
    """The OOM kills so far in each memory sub-cgroup of ``subs`` (v1: not counted in the container's)."""
    return {c: oom_kills(c) for c in subs if (c / "memory.oom_control").is_file()}


def oom_notes(phase: str, before: dict[Path, int | None], after: dict[Path, int | None],
              limits: dict[str, int], trial_mb: int | None) -> list[str]:
    """What the OOM killer did in the phases' own memory sub-cgroups while ``phase`` ran
    (:func:`oom_snapshot` before and after; ``limits``: each phase's MiB): in its own, the phase
    hit its limit ("memory limit hit", as the verdict and ``polar tasks check`` read it); in
    another's (the agent's leftovers while the verifier runs), those processes were held to that
    phase's limit, and the running phase's memory was not touched."""
    notes = []
    for c, n in after.items():
        was = before.get(c)
        if n is None or was is None or n <= was:
            continue
        owner = c.name.removeprefix("polar-")
        if owner == phase:
            notes.append(f"memory limit hit: the OOM killer ended {n - was} process(es) of the {phase} phase "
                         f"at its own {limits.get(owner)} MiB (a sub-cgroup under the trial's {trial_mb} MiB)")
        else:
            notes.append(f"the OOM killer ended {n - was} process(es) the {owner} phase left running, at its "
                         f"own {limits.get(owner)} MiB, while the {phase} phase ran (the {phase} phase's memory "
                         f"untouched)")
    return notes


def remove(sub: Path) -> None:
    """Remove ``sub`` once its processes are gone (the container removed); never raises."""
    for _ in range(20):
        try:
            sub.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
