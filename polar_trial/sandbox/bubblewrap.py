"""``bubblewrap``: the default sandbox on Linux (Debian's ``bubblewrap`` package).

What one phase sees (docs/sandbox.md has the full table):

* a fresh root: the host's /usr (and the /bin, /lib* links to it), /etc without its secrets
  (shadow files, SSH host keys, /etc/ssl/private) and /opt, all read-only; its own /proc, /dev,
  and a private tmpfs /tmp and /var/tmp (size-capped by ``disk_mb``); nothing else of the host:
  not the user's HOME, not the repository, not other samples' dirs, not the host's /tmp;
* the work dir read-write at ``workdir``, the isolated HOME read-write, the spec's extra binds;
* its own PID, IPC, UTS (and cgroup) namespaces; ``--die-with-parent``; when the command exits,
  whatever it left running is counted and killed, and a timeout kills the whole namespace;
* no network at all (``--unshare-net``: only its own loopback), except the model proxy: the host
  relays a job-private Unix socket to the proxy's port, and inside, 127.0.0.1:<same port> relays to
  that socket, so HTTPS_PROXY and base-URL modes are unchanged; ``egress``: the package registries
  through a filtering proxy (``egress.py``); ``network=True`` (a model proxy on another machine
  only) shares the host's network;
* a root caller's phase holds no privilege (``_init.py``): an unprivileged host uid range of its
  own (``uidrange.py``: per-uid kernel limits are not shared between concurrent samples), uid 0
  inside a user and mount namespace of its own, no capability (or, with ``userns_caps``, only over
  its own namespaces), no_new_privs, a seccomp filter;
* nothing the task controls reaches what starts the sandbox with privilege (the host's sh and
  bwrap, the init until its drop): they run with a fixed environment (``HOST_ENV``) in /, the
  phase's environment is applied only at the phase's own execve, and no bind, the work dir
  included, may land where the privileged start runs from (``SandboxSpec.check_mounts``: /, /run,
  /proc, /dev, /sys, the system dirs);
* pids/memory/CPU limits through a cgroup where one can be created (``cgroups.py``); the work dir,
  HOME and the other writable binds together on one loop-mounted image of ``disk_mb``
  (``diskimage.py``: hard, ENOSPC); without root, RLIMIT_FSIZE and a watchdog that kills the phase
  when the work dir outgrows ``disk_mb`` (polled every 0.25 s: a fast writer overshoots).

Start-up (``benchmarks/bench_sandbox.py``, ``true``, medians of 20 interleaved rounds, quiet
machine, before the root hardening): 67.5 ms against 2.0 ms for a plain subprocess; 119.8 ms with a
cgroup per phase and the disk cap; 76.6 ms with the proxy relay. The hardening adds ~1-6 ms, the
disk image ~35 ms (under load, 2026-12-03). A harness phase takes tens of seconds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import shutil
import tempfile
import time
from pathlib import Path

from polar_trial.sandbox.base import (SYSTEM_DIRS, Sandbox, SandboxError, SandboxResult, SandboxSpec, Stream,
                                        supervise)
from polar_trial.sandbox.cgroups import Cgroup
from polar_trial.sandbox import loopdev
from polar_trial.sandbox.diskimage import DiskImage
from polar_trial.sandbox.egress import EgressProxy, egress_env, egress_port
from polar_trial.sandbox.hostfs import give_to_sandbox
from polar_trial.sandbox.relay import UnixToTcpRelay
from polar_trial.sandbox.uidrange import UID_COUNT, MapWriter, lease_uid_range

# base.SYSTEM_DIRS are the host's system dirs visible read-only (the ones that are symlinks, e.g.
# /bin -> usr/bin on a merged-/usr system, are recreated as the same symlinks).
#: Parts of /etc that are secrets: files are covered with /dev/null, dirs with an empty tmpfs.
ETC_SECRETS = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-",
               "/etc/security/opasswd", "/etc/ssh", "/etc/ssl/private", "/etc/sudoers.d")
#: The in-sandbox init runs with the host's system Python (not the repository's venv).
PYTHON = "/usr/bin/python3"
PRIVATE = "/run/polar-sandbox"  # where the job-private dir (init script, proxy socket) appears
DISK_POLL_S = 0.25
#: The whole environment of the host-side processes that start a sandbox (the cgroup join's
#: /bin/sh, bwrap, both real root outside any namespace) and of the privileged init inside: fixed,
#: nothing of the phase's. A task's ENV LD_PRELOAD=./evil.so, resolved against Polar's cwd, was
#: loaded into the host's sh and bwrap with every capability (LD_LIBRARY_PATH, LD_AUDIT, LOCPATH
#: and GCONV_PATH likewise). The phase's environment (``spec.env``) goes to the init in a file of
#: the job-private dir, and is applied only at the unprivileged child's execve.
HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
HOST_ENV = {"PATH": HOST_PATH, "LANG": "C.UTF-8"}
#: The host-side processes run in / (no relative path of anyone's resolves against Polar's cwd).
HOST_CWD = "/"
#: What the in-sandbox init keeps of a root caller's capabilities, only until its child has become
#: the range's uid (before any code of the phase runs; then the init drops to the range's init uid
#: and the kernel clears them all). The user-namespace maps, which take CAP_SYS_ADMIN and
#: CAP_SETFCAP too, are written by the host (``uidrange.MapWriter``). CAP_SETPCAP only lets the
#: init empty its bounding set but for these two, first thing (bwrap 0.8 leaves it whole).
INIT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")


def hardened() -> bool:
    """False only under POLAR_SANDBOX_UNHARDENED=1: the configuration before the root hardening
    (every capability of a root caller, no seccomp, the disk watchdog), which the adversarial tests
    run against to show that each attack they make works there. Never for real runs."""
    return os.environ.get("POLAR_SANDBOX_UNHARDENED") != "1"


def _du_bytes(root: Path, limit: int) -> int:
    """Bytes allocated under ``root`` (not following links), stopping once past ``limit``."""
    total, stack = 0, [str(root)]
    while stack and total <= limit:
        d = stack.pop()
        with contextlib.suppress(OSError), os.scandir(d) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
    return total


@functools.lru_cache(maxsize=1)
def _bwrap_path() -> str | None:
    """bwrap's absolute path, looked up once on a fixed PATH (never the phase's or a relative one)."""
    found = shutil.which("bwrap", path="/usr/local/sbin:/usr/local/bin:" + HOST_PATH)
    return os.path.abspath(found) if found else None


class BubblewrapSandbox(Sandbox):
    name = "bubblewrap"

    @classmethod
    def bwrap(cls) -> str | None:
        return _bwrap_path()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if cls.bwrap() is None:
            return "bwrap is not installed (Debian: apt-get install bubblewrap; scripts/setup.sh does it)"
        if not os.access(PYTHON, os.X_OK):
            return f"{PYTHON} is missing (the in-sandbox init runs with the system Python)"
        return None

    def argv(self, spec: SandboxSpec, private: Path, inner: list[str],
             staged: dict[Path, Path] | None = None) -> list[str]:
        """The bwrap command line for ``spec`` (``inner`` runs inside); ``staged`` maps a writable
        bind's host path to its copy on the phase's disk image (bound instead). Raises
        :class:`SandboxError` for a bind (the work dir included) where it could replace what the
        sandbox's privileged start runs (``SandboxSpec.check_mounts``)."""
        spec.check_mounts(host_system_dirs=True)
        bwrap = self.bwrap()
        if bwrap is None:
            raise SandboxError(self.unavailable_reason() or "bwrap is not installed")
        a = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid",
             "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        if not spec.network:
            a.append("--unshare-net")
        if os.geteuid() == 0 and hardened():
            a += ["--cap-drop", "ALL"]
            for cap in INIT_CAPS:
                a += ["--cap-add", cap]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        for s in ETC_SECRETS:
            if os.path.isdir(s) and not os.path.islink(s):
                a += ["--tmpfs", s, "--remount-ro", s]
            elif os.path.lexists(s):
                a += ["--ro-bind", "/dev/null", s]
        size = ["--size", str(spec.disk_mb * 1024 * 1024)] if spec.disk_mb else []
        a += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", *size, "--tmpfs", "/tmp",
              "--perms", "1777", *size, "--tmpfs", "/var/tmp",
              "--tmpfs", "/run", "--ro-bind", str(private), PRIVATE]
        if spec.network:
            # a resolv.conf that links into /run (systemd-resolved) must survive the private /run
            resolv = os.path.realpath("/etc/resolv.conf")
            if resolv.startswith("/run/") and os.path.exists(resolv):
                a += ["--ro-bind", resolv, resolv]
        made: set[str] = {"/", "/tmp", "/var", "/var/tmp", "/run", PRIVATE}
        for host, dest, writable in spec.mounts():
            dest = "/" + os.path.normpath(dest).lstrip("/")
            if not writable and dest == str(host) and any(dest == d or dest.startswith(d + "/") for d in SYSTEM_DIRS):
                continue  # the host's own file at its own place, read-only: already shown as it is (secrets covered)
            # the dirs a bind's path goes through: 0755 (bwrap would make them 0700, root's, which
            # the phase's unprivileged uid could not pass)
            for anc in reversed(Path(dest).parents):
                if str(anc) not in made and not any(str(anc) == d or str(anc).startswith(d + "/")
                                                    for d in (*SYSTEM_DIRS, "/proc", "/dev")):
                    a += ["--perms", "0755", "--dir", str(anc)]
                made.add(str(anc))
            if not host.exists():
                raise SandboxError(f"sandbox bind source {host} does not exist")
            under = next((d for d in SYSTEM_DIRS if dest.startswith(d + "/")), None)
            if under and not os.path.exists(dest):  # a writable bind at its own path under /opt
                raise SandboxError(f"cannot bind {host} at {dest}: {under} is the host's, read-only, and "
                                   f"has no {dest} to mount on (bind it at a path of its own)")
            src = (staged or {}).get(host, host) if writable else host
            a += ["--bind" if writable else "--ro-bind", str(src), dest]
        a += ["--chdir", spec.workdir, "--", *inner]
        return a

    def run(self, spec: SandboxSpec, argv: list[str], *, stdout: Stream = None,
            stderr: Stream = None) -> SandboxResult:
        if not argv:
            raise SandboxError("nothing to run")
        spec.check_mounts(host_system_dirs=True)  # before anything is made or chowned for it
        spec.workdir_host.mkdir(parents=True, exist_ok=True)
        if spec.home_host is not None:
            spec.home_host.mkdir(parents=True, exist_ok=True)
        notes: list[str] = []
        private = Path(tempfile.mkdtemp(prefix="polar-sandbox-"))
        relay: UnixToTcpRelay | None = None
        cg: Cgroup | None = None
        image: DiskImage | None = None
        egress: EgressProxy | None = None
        uids = None
        mapper: MapWriter | None = None
        r_fd, w_fd = os.pipe()
        try:
            shutil.copy(Path(__file__).with_name("_init.py"), private / "init.py")
            cfg: dict = {"report_fd": w_fd, "harden": hardened(), "env_file": f"{PRIVATE}/env.json"}
            if spec.proxy_port and not spec.network:
                relay = UnixToTcpRelay(private / "proxy.sock", spec.proxy_port)
                cfg.update(proxy_port=spec.proxy_port, socket=f"{PRIVATE}/proxy.sock")
            env = dict(spec.env)
            if spec.egress and not spec.network:
                egress = EgressProxy(private / "egress.sock", spec.egress)
                port = egress_port(spec)
                cfg["relays"] = [[port, f"{PRIVATE}/egress.sock"]]
                env.update(egress_env(port))
            # the phase's environment: read by the init (0600, the caller's), applied at its child's
            # execve only; a file, not argv (a harness's env can be long) nor the init's own env
            fd = os.open(private / "env.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(env, fh)
            staged: dict[Path, Path] = {}
            writable = [host for host, _, w in spec.mounts() if w]
            if os.geteuid() == 0 and hardened():
                # a root caller: the phase runs as an unprivileged uid range of its own (see
                # _init.py, uidrange.py), so its writable binds become that uid's; the init keeps
                # the private dir and socket
                uids = lease_uid_range()
                mapper = MapWriter(uids)
                cfg["drop"] = {"uid_base": uids.base, "count": UID_COUNT, "init_uid": uids.init_uid,
                               "map_fd": mapper.child_fd, "keep_caps": spec.userns_caps}
                os.chmod(private, 0o711)  # the init (root, no CAP_DAC_*) reads init.py; no listing
                for sock in ("proxy.sock", "egress.sock"):
                    if (private / sock).exists():
                        os.chown(private / sock, uids.init_uid, uids.init_uid)  # 0600: the init's alone
                if spec.disk_mb:
                    try:
                        image = DiskImage(spec.disk_mb, uids.base)
                        staged = image.stage(writable)
                    except loopdev.LoopDeviceTimeout as exc:  # waited its turn and none came: loud, never the watchdog
                        raise SandboxError(str(exc)) from exc
                    except Exception as exc:  # noqa: BLE001 - any failure: the watchdog, said in the notes
                        notes.append(f"disk image unavailable ({exc}); the disk cap falls back to a watchdog")
                        if image is not None:
                            image.close()
                            image = None
                if image is None:
                    for host in writable:
                        give_to_sandbox(host, uids.base)
            if spec.disk_mb:
                cfg["fsize"] = spec.disk_mb * 1024 * 1024
            # -I: the phase's PYTHONPATH/PYTHONHOME (a harness's env) must not reach the init; -S: no site (~10 ms)
            inner = [PYTHON, "-I", "-S", f"{PRIVATE}/init.py", json.dumps(cfg), "--", *argv]
            cmd = self.argv(spec, private, inner, staged)
            cg = Cgroup.create(pids=spec.pids, memory_mb=spec.memory_mb, cpus=spec.cpus, notes=notes)
            if cg is not None:
                # Join the cgroup before exec'ing bwrap, so no process of the phase starts outside.
                files = cg.procs_files
                join = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
                cmd = ["/bin/sh", "-c", join, "sh", str(len(files)), *files, *cmd]
            # nothing of the phase's environment, and no relative path, reaches the host-side
            # processes (root) or the init (privileged until the phase's ids are mapped)

            seen = {"procs": 0, "disk": 0, "next_du": 0.0}
            limit = (spec.disk_mb or 0) * 1024 * 1024 if image is None else 0  # the image is the cap

            def poll() -> str | None:
                if cg is not None:
                    seen["procs"] = max(seen["procs"], len(cg.pids()))
                if limit and time.monotonic() >= seen["next_du"]:
                    t0 = time.monotonic()
                    used = _du_bytes(spec.workdir_host, limit)
                    # a big work dir (14k files: ~50 ms hot, ~480 ms cold per walk) is walked at
                    # most a tenth of the time, so the watchdog never costs more than 10% of a core
                    seen["next_du"] = time.monotonic() + 9 * (time.monotonic() - t0)
                    if used > limit:
                        seen["disk"] = used
                        return f"disk limit hit: the work dir grew past {spec.disk_mb} MiB; the phase was killed"
                return None

            wants_poll = cg is not None or bool(limit)
            rc, timed_out, reason, wall = supervise(
                cmd, env=dict(HOST_ENV), cwd=HOST_CWD, stdout=stdout, stderr=stderr, timeout_s=spec.timeout_s,
                pass_fds=(w_fd,) if mapper is None else (w_fd, mapper.child_fd),
                on_start=(lambda _: mapper.started()) if mapper is not None else None,
                poll=poll if wants_poll else None,
                poll_interval_s=DISK_POLL_S)
            os.close(w_fd)
            w_fd = -1
            report = _read_report(r_fd)
            if mapper is not None and mapper.error:
                notes.append(f"the phase's user ids were not mapped: {mapper.error}")
            if cg is not None:
                left = cg.kill_all()
                if left:
                    notes.append(f"killed {left} process(es) still in the sandbox's cgroup")
                notes += cg.events()
            if timed_out:
                n = f" ({seen['procs']} process(es) running)" if seen["procs"] else ""
                notes.append(f"timed out after {spec.timeout_s:g} s: the sandbox and every process in it killed{n}")
            if reason:
                notes.append(reason)
            if report and not report.get("swept"):
                notes.append("leftover processes not swept: the sandbox has no PID namespace of its own")
            if report.get("leftovers"):
                notes.append(f"killed {report['leftovers']} leftover process(es) when the command exited")
            if isinstance(report.get("relay"), str):
                notes.append(f"model proxy relay failed inside the sandbox: {report['relay']}")
            if relay is not None:
                notes.append(f"model proxy reachable only as 127.0.0.1:{spec.proxy_port} "
                             f"({relay.connections} connection(s) relayed)")
            if image is not None:
                used = image.used_mb()
                try:
                    image.unstage()  # every process of the phase is gone: copy its writes back
                except Exception as exc:  # noqa: BLE001 - the phase's files, not the host's, are at stake
                    raise SandboxError(f"the phase's writes could not be copied back from its disk image: {exc}") from exc
                if image.skipped:
                    notes.append(f"{image.skipped} special file(s) (FIFOs, sockets, devices) not copied back")
                notes.append(f"disk: /tmp capped at {spec.disk_mb} MiB (tmpfs); work dir and HOME capped "
                             f"together at {spec.disk_mb} MiB (a disk image; {used:.1f} MiB used)")
                if used >= spec.disk_mb * 0.98:
                    notes.append(f"disk limit hit: the work dir and HOME filled their {spec.disk_mb} MiB")
            elif spec.disk_mb:
                notes.append(f"disk: /tmp capped at {spec.disk_mb} MiB (tmpfs); work dir capped at "
                             f"{spec.disk_mb} MiB per file (RLIMIT_FSIZE) and in total by a watchdog")
            if egress is not None:
                notes.append(f"no network but the package registries through a filtering proxy "
                             f"({len(egress.passed)} connection(s) let through, {len(egress.refused)} refused)")
                notes += [f"egress refused: {why}" for why in egress.refused[:5]]
            else:
                notes.append("no network" if not spec.network else
                             "host network shared (the model proxy is on another machine)")
            if (timed_out or reason) and rc >= 0:
                rc = -9
            special = [str(p) for p in image.special] if image is not None else []
            return SandboxResult(rc, timed_out, notes, wall, special_files=special)
        finally:
            if w_fd >= 0:
                os.close(w_fd)
            os.close(r_fd)
            if relay is not None:
                relay.close()
            if egress is not None:
                egress.close()
            if cg is not None:
                cg.kill_all()
                cg.remove()
            if image is not None:
                image.release()
            if mapper is not None:
                mapper.close()
            if uids is not None:
                uids.release()  # every process of the range is gone: the PID namespace ended with bwrap
            shutil.rmtree(private, ignore_errors=True)


#: the init's report is a few hundred bytes; more is not a report
REPORT_LIMIT = 64 * 1024


def _read_report(fd: int, wait_s: float = 1.0) -> dict:
    """The init's JSON report (empty when the sandbox was killed before it wrote one, or when what
    came is not a report: over REPORT_LIMIT, not a JSON object)."""
    chunks, deadline, size = [], time.monotonic() + wait_s, 0
    while size <= REPORT_LIMIT:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
        size += len(data)
    if size > REPORT_LIMIT:
        return {}
    with contextlib.suppress(ValueError):
        report = json.loads(b"".join(chunks) or b"{}")
        if isinstance(report, dict):
            return report
    return {}
