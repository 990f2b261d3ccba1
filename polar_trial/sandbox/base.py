"""The sandbox interface: what one phase (agent, oracle, verifier) asks of a sandbox, and what it
reports back. Every backend (bubblewrap, docker, ...) implements ``Sandbox.run`` on the same
``SandboxSpec``; the rollout runner never knows which one it has.

Paths: the spec names *host* paths and where each appears *inside*. The task's work dir is bound
at ``workdir`` (Harbor's WORKDIR, ``/app`` by default). The isolated HOME is bound at ``home``,
which defaults to the same absolute path as on the host, so the config files a harness preset
wrote there with absolute paths (``CODEX_HOME``, settings.json) stay valid inside; ``inside()``
maps any host path of the spec to its sandbox path (for env values such as ``POLAR_WORKDIR``).
A container backend that ``copies_home`` (docker, podman) is given a harness's HOME as
``home_copy`` instead: copied into the image user's passwd HOME, the paths under it moved there by
the container's init, never bound (``harnesshome.py``).

Limits the kernel cannot enforce on this machine are not silently dropped: the result's ``notes``
say, per run, which limits were enforced and how, and what was contained (processes killed at the
end of the phase, a disk or memory cap hit, a timeout).
"""

from __future__ import annotations

import abc
import os
import posixpath
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Union

from polar_core.processes import kill_group
from polar_core import cancel

#: What ``stdout``/``stderr`` may be: an open file, a raw fd, or None (inherit).
Stream = Union[IO[bytes], IO[str], int, None]


class SandboxError(RuntimeError):
    """The sandbox could not be set up (backend missing, bad spec); the phase did not run."""


class SandboxUnavailable(SandboxError):
    """The requested backend is not usable on this machine (the message says why)."""


# ---------------------------------------------------------------------------------------------
# where a bind may go inside (the work dir, a task's WORKDIR, is a bind too)

#: No bind may be at or under these on any backend: the kernel's file systems, and /run, which
#: holds the sandbox's own machinery (bubblewrap's init and its job-private dir at
#: /run/polar-sandbox, the container backends' /run/polar-* dirs). A task's WORKDIR at the init's
#: private dir made the task's own init.py run as the privileged init.
RESERVED_DIRS = ("/proc", "/dev", "/sys", "/run")
#: The host's system dirs, which bubblewrap shows read-only (and, for those that are links on a
#: merged-/usr system, as the same links). The privileged start of a bubblewrap sandbox runs from
#: them (``/usr/bin/python3 -I -S``: its whole ``sys.path`` is under /usr/lib; the loader reads
#: /etc/ld.so.*), so no bind may land there: a WORKDIR at /usr/lib/python3.11 was the init's stdlib.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc", "/opt")


def _within(path: str, dirs: tuple[str, ...]) -> str | None:
    return next((d for d in dirs if path == d or path.startswith(d + "/")), None)


def sandbox_path(path: str, what: str, *, host_system_dirs: bool = False) -> str:
    """``path`` (a place inside the sandbox) normalised (``..``, ``//``, a trailing ``/``), or
    :class:`SandboxError` naming it when a bind there could replace what the sandbox itself runs:
    ``/``, :data:`RESERVED_DIRS` and what lies under them, and with ``host_system_dirs`` (a
    backend that shows the host's system dirs, i.e. bubblewrap) :data:`SYSTEM_DIRS` too."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise SandboxError(f"{what} must be an absolute path inside the sandbox, not {path!r}")
    norm = "/" + posixpath.normpath(path).lstrip("/")  # "//run/" and "/app/../run" are "/run"
    if norm == "/":
        raise SandboxError(f"{what} {path!r} refused: a bind at / would replace the sandbox's whole root")
    shown = f"{path!r}" if norm == path else f"{path!r} (that is {norm})"
    if (d := _within(norm, RESERVED_DIRS)) is not None:
        why = ("the sandbox's own machinery (its init, private dir and sockets)" if d == "/run"
               else "a kernel file system")
        raise SandboxError(f"{what} {shown} refused: {d} is {why}; no bind may be at or under it")
    if host_system_dirs and (d := _within(norm, SYSTEM_DIRS)) is not None:
        raise SandboxError(f"{what} {shown} refused: {d} is the host's system dir, read-only, which the "
                           f"sandbox's privileged start runs from; no bind may be at or under it "
                           f"(use a path of its own, such as /app)")
    return norm


@dataclass
class SandboxSpec:
    """One phase's sandbox. Only ``workdir_host`` is required."""

    workdir_host: Path
    #: where the work dir appears inside (the Dockerfile's WORKDIR); also the initial cwd
    workdir: str = "/app"
    #: the isolated HOME (harness config, sessions); bound read-write at ``home``
    home_host: Path | None = None
    #: where HOME appears inside; None = the same absolute path as on the host
    home: str | None = None
    #: container backends that copy HOME (``copies_home``: docker, podman): the host HOME a harness
    #: preset wrote, set *instead of* ``home_host``: copied into the phase user's passwd HOME in
    #: the image and read back after the phase (``harnesshome.py``), never bound
    home_copy: Path | None = None
    #: (host path, path inside) pairs; a path inside of "" means the same path as on the host
    ro_binds: list[tuple[Path, str]] = field(default_factory=list)
    rw_binds: list[tuple[Path, str]] = field(default_factory=list)
    #: the whole environment of the phase (nothing is inherited from the caller)
    env: dict[str, str] = field(default_factory=dict)
    #: True shares the host's network namespace: only for a model proxy on another machine (no
    #: loopback port to relay); never for a task's ``allow_internet`` (see ``egress``)
    network: bool = False
    #: the package registries this phase may reach, through the filtering proxy of ``egress.py``
    #: (its own network namespace; nothing else, never the host's loopback); () = none. Build steps
    #: and the verifier get them, the agent phase never does
    egress: tuple[str, ...] = ()
    #: the model proxy's host loopback port: reachable inside at 127.0.0.1:<same port> only
    proxy_port: int | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    #: the most processes (and threads) alive at once in the sandbox
    pids: int | None = None
    #: cap on what the phase may write to its work dir (and, separately, to its private /tmp)
    disk_mb: int | None = None
    timeout_s: float = 600.0
    #: False: the phase's uid 0 holds no capability at all. True: it keeps them over its *own*
    #: namespaces (a user namespace of its own; never the host's): for the verifier, whose test.sh
    #: runs the tested program as another uid, and for build steps (apt drops to _apt)
    userns_caps: bool = False
    #: container backends (docker): the image to run, i.e. the task's built environment;
    #: bubblewrap ignores it (its environment is the host's toolchain)
    image: str | None = None

    def __post_init__(self) -> None:
        self.workdir_host = Path(os.path.abspath(self.workdir_host))
        if self.home_host is not None:
            self.home_host = Path(os.path.abspath(self.home_host))
        if self.home_copy is not None:
            self.home_copy = Path(os.path.abspath(self.home_copy))
        self.workdir = sandbox_path(self.workdir, "the work dir")
        if self.home is not None:
            self.home = sandbox_path(self.home, "HOME")
        self.ro_binds = [(Path(os.path.abspath(h)), d and sandbox_path(d, f"the bind of {h}"))
                         for h, d in self.ro_binds]
        self.rw_binds = [(Path(os.path.abspath(h)), d and sandbox_path(d, f"the bind of {h}"))
                         for h, d in self.rw_binds]

    def check_mounts(self, *, host_system_dirs: bool) -> None:
        """Every bind's place inside, the work dir's and HOME's included, checked as the backend
        will mount them (:func:`sandbox_path`; raises :class:`SandboxError` naming the first bad
        one). A read-only bind at its own host path changes nothing a system dir shows (bubblewrap
        skips it); a writable one is allowed under /opt only, which holds nothing the sandbox's
        start runs (a checkout or POLAR_HOME there keeps its run dirs working). And no bind may lie
        under an earlier *writable* one: the phase can put a link there (its HOME from an earlier
        turn, a task's build), and a mount follows links in its destination, so a work dir at
        ``<HOME>/x`` with ``x -> /run/...`` would be mounted over the init's private dir."""
        writable: list[str] = []
        for host, dest, rw in self.mounts():
            what = ("the work dir" if (host, dest) == (self.workdir_host, self.workdir) else
                    "HOME" if (host, dest) == (self.home_host, self.home_inside) else f"the bind of {host}")
            norm = sandbox_path(dest, what)
            if norm != str(host) or (rw and _within(norm, SYSTEM_DIRS) != "/opt"):
                norm = sandbox_path(dest, what, host_system_dirs=host_system_dirs)
            outer = next((w for w in writable if norm.startswith(w + "/")), None)
            if outer is not None:
                raise SandboxError(f"{what} at {norm} refused: it lies under {outer}, a writable bind mounted "
                                   "before it, where a link the phase left would redirect the mount")
            if rw:
                writable.append(norm)

    @property
    def home_inside(self) -> str | None:
        if self.home_host is None:
            return None
        return self.home or str(self.home_host)

    def mounts(self) -> list[tuple[Path, str, bool]]:
        """(host, inside, writable) for every bind, work dir and HOME included, in mount order."""
        out: list[tuple[Path, str, bool]] = [(h, d or str(h), False) for h, d in self.ro_binds]
        out += [(h, d or str(h), True) for h, d in self.rw_binds]
        if self.home_host is not None:
            out.append((self.home_host, self.home_inside or str(self.home_host), True))
        out.append((self.workdir_host, self.workdir, True))
        return out

    def inside(self, host_path: str | os.PathLike[str]) -> str:
        """The sandbox path of a host path under one of the spec's binds (longest match wins);
        a path under none of them is returned unchanged (it is not visible inside)."""
        p = Path(os.path.abspath(host_path))
        best: tuple[int, str] | None = None
        for host, dest, _ in self.mounts():
            if p == host or host in p.parents:
                n = len(host.parts)
                if best is None or n > best[0]:
                    best = (n, str(Path(dest) / p.relative_to(host)) if p != host else dest)
        return best[1] if best else str(p)


@dataclass
class SandboxResult:
    returncode: int  # the command's exit status; -N when killed by signal N (e.g. on timeout)
    timed_out: bool
    #: what was contained or enforced, one sentence each
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    #: host paths where the phase left a special file (FIFO, socket, device) that was not copied
    #: back from its disk image: nothing is there on the host, but something was
    special_files: list[str] = field(default_factory=list)


class Sandbox(abc.ABC):
    """One backend. ``run`` blocks until the phase is over and every process of it has ended."""

    #: the name ``get_sandbox`` knows it by
    name: str = ""
    #: False only for the pass-through ``host`` backend (no isolation at all)
    isolates: bool = True

    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can run here; otherwise why not (shown to the user). A check only:
        test modules call it at collection, so it sets nothing up (``open`` does)."""

    @classmethod
    def open(cls) -> Sandbox:
        """The backend, ready to run (``get_sandbox``): what it must set up first is done here
        (podman: the store of Polar's own)."""
        return cls()

    @abc.abstractmethod
    def run(self, spec: SandboxSpec, argv: list[str], *, stdout: Stream = None,
            stderr: Stream = None) -> SandboxResult:
        """Run ``argv`` (resolved inside the sandbox, cwd = ``spec.workdir``) with ``spec.env``."""

    def inside(self, spec: SandboxSpec, host_path: str | os.PathLike[str]) -> str:
        """Where ``host_path`` (under one of the spec's binds) is seen by the command: use it for
        paths put in ``spec.env`` or ``argv``. The ``host`` backend sees host paths unchanged."""
        return spec.inside(host_path)


# ---------------------------------------------------------------------------------------------
# running one process tree with a hard timeout (shared by the backends)

#: Sandboxed phases running now, for ``terminate_all`` (Ctrl-C of a rollout).
_ACTIVE: set[subprocess.Popen] = set()
_ACTIVE_LOCK = threading.Lock()


def terminate_all() -> int:
    """Kill every running sandboxed phase (each leads its own process group). Returns how many."""
    with _ACTIVE_LOCK:
        procs = list(_ACTIVE)
    for proc in procs:
        kill_group(proc, grace=1.0)
    return len(procs)


def supervise(argv: list[str], *, env: dict[str, str] | None, cwd: str | os.PathLike[str] | None,
              stdout: Stream, stderr: Stream, timeout_s: float, pass_fds: tuple[int, ...] = (),
              on_start: Callable[[subprocess.Popen], None] | None = None,
              poll: Callable[[], str | None] | None = None,
              poll_interval_s: float = 0.25) -> tuple[int, bool, str | None, float]:
    """Run ``argv`` in its own process group, stdin closed. After ``timeout_s``, or when ``poll``
    returns a reason (a limit watchdog), the whole group is killed. Returns (returncode,
    timed_out, the poll's reason or None, wall seconds)."""
    t0 = time.monotonic()
    outputs: list[_BoundedOutput] = []
    # One sink for both: one pipe. (Deciding on stderr after stdout was swapped for the pipe's
    # write end made that int a "sink" of its own: a second pump wrote stderr to the write end
    # the parent closes after the start, got EBADF and closed its read end, and the next write
    # to stderr killed the phase with SIGPIPE: the docker CLI's rc -13 in TB2's verifier.)
    same = _is_sink(stdout) and stderr is stdout
    if _is_sink(stdout):
        outputs.append(_BoundedOutput(stdout))
        stdout = outputs[0].w
    if same:
        stderr = stdout
    elif _is_sink(stderr):
        outputs.append(_BoundedOutput(stderr))
        stderr = outputs[-1].w
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=stderr, start_new_session=True, pass_fds=pass_fds)
    finally:
        for o in outputs:
            o.started()
    with _ACTIVE_LOCK:
        _ACTIVE.add(proc)
    cancel.track(proc)  # a dropped straggler group's phases are killed with it (polar_core/cancel.py)
    timed_out, reason = False, None
    try:
        if on_start is not None:
            on_start(proc)
        deadline = t0 + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                proc.wait(timeout=min(left, poll_interval_s) if poll else left)
                break
            except subprocess.TimeoutExpired:
                pass
            if poll is not None and (reason := poll()) is not None:
                break
    finally:
        # On timeout, a watchdog's reason or Ctrl-C the whole group goes; after a clean exit,
        # whatever it left in the group goes too.
        kill_group(proc, grace=0.0)
        cancel.untrack(proc)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(proc)
        for o in outputs:
            o.finish()
    rc = proc.returncode if proc.returncode is not None else -9
    return rc, timed_out, reason, time.monotonic() - t0


#: What a phase's stdout/stderr may put on the host: the first OUTPUT_HEAD bytes and the last
#: OUTPUT_TAIL, with a line saying how much was dropped between (a sample printing 1.5 GiB put
#: 6 GiB on disk and 6 GiB in the host's memory when the verifier read its output back).
OUTPUT_HEAD = 8 * 2**20
OUTPUT_TAIL = 1 * 2**20


def _is_sink(stream: Stream) -> bool:
    return stream is not None and stream not in (subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT)


class _BoundedOutput:
    """A pipe the phase writes to; a thread copies at most OUTPUT_HEAD + OUTPUT_TAIL bytes of it
    into the caller's file (the sample, not the host, pays for the rest: it is read and dropped)."""

    def __init__(self, sink: Stream):
        self.fd = sink if isinstance(sink, int) else sink.fileno()  # type: ignore[union-attr]
        r, self.w = os.pipe()
        self._thread = threading.Thread(target=self._pump, args=(r,), daemon=True)
        self._thread.start()

    def started(self) -> None:
        os.close(self.w)  # the child holds its copy; EOF when every process of the phase is gone

    def _pump(self, r: int) -> None:
        # The read end is closed only at EOF: a sink that fails (EBADF, ENOSPC, EFBIG) stops the
        # copying, never the draining, or the phase's next write would die of SIGPIPE.
        head, tail, dropped = 0, bytearray(), 0
        broken = False

        def write(data: bytes) -> None:
            nonlocal broken
            if not broken:
                try:
                    os.write(self.fd, data)
                except OSError:
                    broken = True

        try:
            while True:
                try:
                    chunk = os.read(r, 65536)
                except InterruptedError:
                    continue
                if not chunk:
                    break
                if head < OUTPUT_HEAD:
                    part = chunk[:OUTPUT_HEAD - head]
                    write(part)
                    head += len(part)
                    chunk = chunk[len(part):]
                if chunk:
                    tail += chunk
                    if len(tail) > OUTPUT_TAIL:
                        dropped += len(tail) - OUTPUT_TAIL
                        del tail[:len(tail) - OUTPUT_TAIL]
            if dropped:
                write(f"\n[polar: {dropped} bytes of output dropped]\n".encode())
            if tail:
                write(bytes(tail))
        except OSError:
            pass
        finally:
            os.close(r)

    def finish(self, wait_s: float = 5.0) -> None:
        self._thread.join(wait_s)
