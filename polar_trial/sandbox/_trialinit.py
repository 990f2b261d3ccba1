"""What ``docker exec`` runs for each phase of a live trial (``trial.py``), as the container's root
with the most privilege any phase needs; it builds the phase's namespaces, drops to the phase's
user and capabilities, and runs ARGV. Stdlib only, on the host's Python bound in (``hostpython.py``);
copied beside the sandbox's init (``_init.py``, imported here as ``init``) into the trial's dir.

    python3 /run/polar-trial/trialinit.py CONFIG_JSON -- ARGV...

Modes (``cfg["mode"]``):

* ``agent``: the agent, oracle or nop. The first agent exec makes the trial's *agent namespaces*:
  a PID namespace whose PID 1 (the holder, this script forked) lives on after the phase, reaping,
  so the servers a phase leaves keep running for the next phase, as under Harbor; a mount
  namespace of its own with a fresh /proc (the agent sees only its own processes) and, covered by
  empty read-only tmpfs mounts, ``/run/polar-trial`` (our dir: the verifier's output, the phase
  binds) and ``/tests`` (where the verifier's tests will be copied). A later agent exec of the
  same trial (a follow-up turn) joins them (``join``: the holder's pid).
* ``verifier``: a PID and a mount namespace of its own, children of the container's: the agent's
  leftovers live in a sibling PID namespace, so they can neither see nor signal the verifier's
  processes, and its ``/logs/verifier`` is a bind of the host's fresh dir in its mount namespace
  only (the leftovers see the image's plain dir there). Files are shared (one root file system):
  the tests see what the agent installed or wrote anywhere, and reach its servers over loopback.
* ``plain``: the container's own namespaces (the healthcheck, the relay).
* ``relay``: the trial's relays (model proxy, registries' filter) for the trial's whole life, in
  the container's own PID namespace, where no phase can signal them or take their ports.
* ``sweep``: SIGKILL every process in the PID namespace of ``cfg["pid"]`` but that pid (a phase's
  timeout: the processes of the phase go, its holder stays).

Then, in the phase's child: the phase's binds (``cfg["binds"]``: [src, dest]: a host mount
propagated under /run/polar-trial/x, bound at dest through an O_PATH|O_NOFOLLOW fd, so a link the
sample planted at dest is never followed), copies (``copy_in``), the user (``cfg["user"]``: a
name or uid from the image's /etc/passwd; HOME from there when ``passwd_home``), the capability
set (``cfg["caps"]``: bounding, permitted, effective and inheritable alike; a non-root user gets
none), ``no_new_privs`` and the sandbox's seccomp filter (no mount, keyring, bpf, ...), then exec.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import init as base  # noqa: E402 - the sandbox's own init, copied beside this file

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_SLAVE = 32, 4096, 16384, 1 << 18, 1 << 19
PR_SET_DUMPABLE, PR_CAPBSET_DROP = 4, 24
#: the paths under /proc that the runtime masks (docker's and podman's defaults): masked again
#: on the fresh /proc of a phase's PID namespace, which would otherwise show them
PROC_MASKED = ("/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
               "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi")
PROC_READONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


def _mount(ctypes, libc, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    base._check(ctypes, libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
                f"mount {src or fstype} on {target}")


def _dir_fd(path: str, create: bool = True) -> int:
    """An O_PATH fd of the directory ``path`` itself, never of a link planted there (one is
    removed and the directory made, a few times, before giving up)."""
    for _ in range(5):
        if create:
            try:
                os.makedirs(path, exist_ok=True)
            except FileExistsError:
                pass
        try:
            return os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
        except (NotADirectoryError, OSError):
            if not create:
                raise
            try:
                os.unlink(path)
            except OSError:
                pass
    raise OSError(f"{path}: not a directory (a link or file is kept there)")


def _bind(ctypes, libc, src: str, dest: str) -> None:
    if os.path.isdir(src):
        fd = _dir_fd(dest)
    else:
        parent = _dir_fd(os.path.dirname(dest))
        try:
            os.close(os.open(os.path.basename(dest), os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o644, dir_fd=parent))
        except OSError:
            pass
        fd = os.open(os.path.basename(dest), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        os.close(parent)
    try:
        _mount(ctypes, libc, src, f"/proc/self/fd/{fd}", None, MS_BIND | MS_REC)
    finally:
        os.close(fd)


def _cover(ctypes, libc, path: str) -> None:
    """An empty read-only tmpfs over ``path`` (made when missing)."""
    fd = _dir_fd(path)
    try:
        _mount(ctypes, libc, "tmpfs", f"/proc/self/fd/{fd}", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
               "size=4k,mode=0755")
    finally:
        os.close(fd)


def _fresh_proc(ctypes, libc) -> None:
    """/proc of the new PID namespace, with the runtime's masks put back."""
    _mount(ctypes, libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for p in PROC_MASKED:
        if os.path.isdir(p):
            _mount(ctypes, libc, "tmpfs", p, "tmpfs", MS_RDONLY, "size=0")
        elif os.path.exists(p):
            _mount(ctypes, libc, "/dev/null", p, None, MS_BIND)
    for p in PROC_READONLY:
        if os.path.exists(p):
            _mount(ctypes, libc, p, p, None, MS_BIND | MS_REC)
            _mount(ctypes, libc, None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def _new_namespaces(ctypes, libc, binds: list, covers: list[str], own: list | None = None) -> None:
    """In the new PID namespace's PID 1: a mount namespace of its own (host mounts still
    propagate in: slave), a fresh /proc, the phase's binds, then our dirs covered. ``own``: dirs
    given a tmpfs of their own first, ([dir, src]: with src's files copied in): the verifier's
    /logs (its mount points are then never made on the shared disk, which the sample may have
    filled), and /tests where uploading it to the shared disk failed (full)."""
    base._check(ctypes, libc.unshare(CLONE_NEWNS), "unshare(mount)")
    _mount(ctypes, libc, None, "/", None, MS_REC | MS_SLAVE)
    _fresh_proc(ctypes, libc)
    for path, src in own or []:
        fd = _dir_fd(path)
        try:
            _mount(ctypes, libc, "tmpfs", f"/proc/self/fd/{fd}", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        finally:
            os.close(fd)
        if src:
            import shutil

            shutil.copytree(src, path, symlinks=True, dirs_exist_ok=True)
    for src, dest in binds:
        _bind(ctypes, libc, src, dest)
    for path in covers:
        _cover(ctypes, libc, path)


def _passwd(user: str) -> tuple[int, int, str, list[int]]:
    """(uid, gid, home, supplementary gids) of ``user`` (a name or a uid) from the image's own
    /etc/passwd and /etc/group, read as files (the image's NSS modules are never loaded here)."""
    entries = []
    try:
        with open("/etc/passwd", errors="replace") as fh:
            entries = [ln.rstrip("\n").split(":") for ln in fh if ln.count(":") >= 6]
    except OSError:
        pass
    name, rec = user, None
    for e in entries:
        if e[0] == user or (user.isdigit() and e[2] == user):
            rec, name = e, e[0]
            break
    if rec is None:
        if user.isdigit():
            return int(user), int(user), "/", []
        raise KeyError(f"user {user!r} is not in the image's /etc/passwd")
    uid, gid, home = int(rec[2]), int(rec[3]), rec[5] or "/"
    groups = []
    try:
        with open("/etc/group", errors="replace") as fh:
            for ln in fh:
                g = ln.rstrip("\n").split(":")
                if len(g) >= 4 and name in g[3].split(",") and g[2].isdigit():
                    groups.append(int(g[2]))
    except OSError:
        pass
    return uid, gid, home, groups


def _read_home(cfg: dict, report: dict) -> None:
    """The harness's HOME (``_homeinit.py``), read here as root in the container's mount namespace
    (the agent's covers our dir, where the host bound it); the phase's child writes it into its
    user's passwd HOME as that user. The HOME goes into the report, for the host's read-back."""
    import homeinit  # ``_homeinit.py``, copied beside this file

    try:
        uid, gid, home, _ = _passwd(str(cfg.get("user") or "0"))
    except KeyError:
        return  # the phase cannot become its user either: it fails there, saying why
    try:
        files = homeinit.read_tree(cfg["home"]["src"])
    except OSError as e:
        print(f"sandbox: the harness's HOME could not be read: {e}", file=sys.stderr)
        files = []
    cfg["_home"] = {"path": home, "uid": uid, "gid": gid, "files": files, "prefix": cfg["home"]["prefix"]}
    report["home"] = home


def _become(ctypes, libc, cfg: dict, env: dict[str, str]) -> None:
    """In the phase's child, last: its user, its capabilities, no_new_privs and seccomp."""
    user = str(cfg.get("user") or "0")
    uid, gid, home, groups = _passwd(user)
    if cfg.get("passwd_home"):
        env["HOME"] = home
    env.setdefault("USER", user if not user.isdigit() else env.get("USER", "root"))
    keep = set(cfg.get("caps") or [])
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    for cap in range(last + 1):
        if cap not in keep:
            base._check(ctypes, libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # a non-root uid: the kernel clears every capability

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    mask = sum(1 << c for c in keep) if uid == 0 else 0
    data = (ctypes.c_uint32 * 6)(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0, mask >> 32, mask >> 32, 0)
    base._check(ctypes, libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")
    base._no_new_privs_and_seccomp()


def _phase_child(cfg: dict, argv: list[str], env: dict[str, str], err_w: int) -> None:
    """Fork the phase's command; never returns in the child. Its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        ctypes, libc = base._libc()
        os.setsid()
        if cfg.get("oom_score_adj"):  # before this init in its memory sub-cgroup's OOM (phasecgroup.OOM_SCORE_ADJ)
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write(str(int(cfg["oom_score_adj"])))
        home = cfg.get("_home")
        if home:  # root still: the user's HOME made where the image names one and has none
            import homeinit  # imported by _read_home before the join (our dir is covered now)

            try:
                homeinit.ensure_home(home["path"], home["uid"], home["gid"])
            except OSError as e:
                print(f"sandbox: the HOME {home['path']} could not be made: {e}", file=sys.stderr)
        _become(ctypes, libc, cfg, env)
        if home:  # the phase's user now: what it writes is its own, through no link
            env, argv = homeinit.rewrite(env, argv, home["prefix"], home["path"])
            for p in homeinit.write_tree(home["path"], home["files"]):
                print(f"sandbox: {p}", file=sys.stderr)
        os.chdir(cfg.get("workdir") or "/")
        env["PWD"] = cfg.get("workdir") or "/"
        os.execvpe(argv[0], argv, env)
    except BaseException as e:  # noqa: BLE001 - the child never returns into this code
        try:
            os.write(err_w, f"{type(e).__name__}: {e}".encode())
        except OSError:
            pass
    os._exit(127)


def _wait(pid: int) -> int:
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        except InterruptedError:
            continue


def _reap_forever() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            signal.pause()
        except InterruptedError:
            pass


def _boot(cfg: dict) -> None:
    """The container's PID 1. Makes the environment's namespaces (PID, mount) with the image's
    ENTRYPOINT and command running in them as the image's user with the phase capabilities (what
    Harbor's container gives it), writes the holder's pid to the boot report, and reaps."""
    ctypes, libc = base._libc()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # `docker stop`/`rm -f`: the container ends
    base._check(ctypes, libc.unshare(CLONE_NEWPID), "unshare(pid)")
    r, w = os.pipe()
    holder = os.fork()
    if holder == 0:
        os.close(r)
        try:
            _new_namespaces(ctypes, libc, [], cfg.get("covers", []))
            env = dict(os.environ)
            err_r, err_w = os.pipe()
            os.set_inheritable(err_w, False)
            _phase_child(cfg, list(cfg["argv"]), env, err_w)
            os.close(err_w)
            os.write(w, b"ok")
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"{type(e).__name__}: {e}".encode())
            os._exit(126)
        os.close(w)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        base._drop_all_capabilities()  # the holder only reaps; the phases join its namespaces
        _reap_forever()
    os.close(w)
    answer = os.read(r, 4096).decode(errors="replace")
    _write_report(os.open(cfg["report_path"], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600),
                  {"holder": holder, "ok": answer == "ok", "error": None if answer == "ok" else answer})
    _reap_forever()


def _verifier_ns(cfg: dict, argv: list[str], env: dict[str, str], status_w: int, err_w: int) -> None:
    """PID 1 of the verifier's own PID namespace: its mount namespace (binds, covers), the phase,
    its status sent up; then it exits, and every process of the namespace ends with it."""
    ctypes, libc = base._libc()
    logs = [["/logs", None]] if any(d == "/logs" or d.startswith("/logs/") for _, d in cfg.get("binds", [])) else []
    _new_namespaces(ctypes, libc, cfg.get("binds", []), cfg.get("covers", []), logs + cfg.get("own", []))
    child = _phase_child(cfg, argv, env, err_w)
    os.close(err_w)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    base._drop_all_capabilities()
    os.write(status_w, json.dumps({"child": child}).encode() + b"\n")
    rc = _wait(child)
    os.write(status_w, json.dumps({"rc": rc}).encode())
    os.close(status_w)
    os._exit(0)


def _in_namespaces_of(pid: int) -> None:
    """Join the PID (for children) and mount namespaces of the holder ``pid``."""
    ctypes, libc = base._libc()
    fds = [(os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC), ns, flag)
           for ns, flag in (("pid", CLONE_NEWPID), ("mnt", CLONE_NEWNS))]
    for fd, ns, flag in fds:
        try:
            base._check(ctypes, libc.setns(fd, flag), f"setns({ns})")
        finally:
            os.close(fd)


def _session_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def _parent_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _phase_processes(pid: int) -> list[int]:
    """The session ``pid`` leads, and every descendant of its processes: a harness that starts its
    tools in sessions of their own (setsid, detached spawns) still has them as its children while
    it lives (a timed-out agent's tool ran on after the sweep of its session alone)."""
    procs = {int(n): (_session_of(n), _parent_of(n)) for n in os.listdir("/proc") if n.isdigit()}
    out = {p for p, (sid, _) in procs.items() if sid == pid}
    grew = True
    while grew:
        more = {p for p, (_, ppid) in procs.items() if ppid in out and p not in out}
        out |= more
        grew = bool(more)
    return sorted(out)


def _sweep(pid: int, everything: bool = False) -> int:
    """SIGKILL the session ``pid`` leads (a phase's command and what it started, in that session or
    as its descendants; a server it left by daemonizing, reparented, stays), or with ``everything`` every process in the PID namespace ``pid`` is PID 1 of
    (the verifier's: it ends with it); how many."""
    if everything:
        try:
            os.kill(pid, signal.SIGKILL)
            return 1
        except OSError:
            return 0
    n = 0
    for _ in range(50):
        left = _phase_processes(pid)
        if not left:
            break
        for p in left:  # noqa: B007
            try:
                os.kill(p, signal.SIGKILL)
                n += 1
            except OSError:
                pass
    return n


def main() -> int:
    cfg = json.loads(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    mode = cfg.get("mode")
    if mode == "boot":
        _boot(cfg)
        return 0
    if mode == "sweep":
        print(json.dumps({"killed": _sweep(int(cfg["pid"]), bool(cfg.get("all")))}))
        return 0
    if mode == "relay":
        for port, path in cfg.get("relays", []):
            base._relay(int(port), path)
        base._drop_all_capabilities()
        print("ready", flush=True)
        while True:
            signal.pause()
    env = dict(os.environ)
    report: dict = {}
    for cg in cfg.get("cgroups", []):  # the phase's own limits: this init, and all it starts, join them
        with open(os.path.join(cg, "cgroup.procs"), "w") as fh:
            fh.write("0")
    # opened here, in the container's own mount namespace (the environment's covers our dir)
    rfd = os.open(cfg["report_path"], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600) \
        if cfg.get("report_path") else None
    for src, dest in cfg.get("copy_in", []):  # uploaded as Harbor does, into the shared file system
        import shutil

        try:
            # the phase's copy replaces what an earlier phase left there (Harbor empties /tests
            # before each step's verifier); a link planted at dest is removed, never followed
            if os.path.islink(dest):
                os.unlink(dest)
            elif os.path.isdir(dest):  # emptied, the dir itself kept: a mount point a full disk cannot remake
                for name in os.listdir(dest):
                    p = os.path.join(dest, name)
                    if os.path.isdir(p) and not os.path.islink(p):
                        shutil.rmtree(p)
                    else:
                        os.unlink(p)
            shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
        except OSError as e:
            if mode == "verifier":  # a disk the sample filled: the tests on a tmpfs of the verifier's own
                cfg.setdefault("own", []).append([dest, src])
            else:
                print(f"sandbox: copying {src} to {dest} failed: {e}", file=sys.stderr)
    if cfg.get("home") and mode == "agent":
        _read_home(cfg, report)
    err_r, err_w = os.pipe()
    os.set_inheritable(err_w, False)
    ctypes, libc = base._libc()
    if mode == "agent":  # in the environment's namespaces, beside what the image and earlier phases left
        _in_namespaces_of(int(cfg["join"]))
        child = _phase_child(cfg, argv, env, err_w)
        os.close(err_w)
        report["session"] = child
        _write_report(rfd, report)
        rc = _wait(child)
    elif mode == "verifier":
        status_r, status_w = os.pipe()
        os.set_inheritable(status_w, False)
        base._check(ctypes, libc.unshare(CLONE_NEWPID), "unshare(pid)")
        holder = os.fork()
        if holder == 0:
            os.close(status_r)
            os.close(err_r)
            try:
                _verifier_ns(cfg, argv, env, status_w, err_w)
            except BaseException as e:  # noqa: BLE001
                try:
                    os.write(err_w, f"{type(e).__name__}: {e}".encode())
                except OSError:
                    pass
            os._exit(126)
        os.close(err_w)
        os.close(status_w)
        report["holder"] = holder
        _write_report(rfd, report)  # the timeout ends the namespace by this pid
        got = b""
        while True:
            chunk = os.read(status_r, 4096)
            if not chunk:
                break
            got += chunk
        # no status and no setup error (below): the namespace's PID 1 was killed before its command
        # ended (nothing of ours does that but the timeout's sweep): as killed by SIGKILL, so the
        # verdict is the sample's 0; a setup error of ours stays an error (126: no signal)
        rc = None
        for line in got.splitlines():
            try:
                rc = int(json.loads(line)["rc"])
            except (ValueError, KeyError, TypeError):
                continue
        _wait(holder)
    else:  # plain: the container's own namespaces (the healthcheck)
        child = _phase_child(cfg, argv, env, err_w)
        os.close(err_w)
        rc = _wait(child)
    err = os.read(err_r, 4096)
    if rc is None:
        rc = 126 if err else -9
    if err:
        print(f"sandbox: cannot run {argv[:1]}: {err.decode(errors='replace')}", file=sys.stderr)
    report["returncode"] = rc
    _write_report(rfd, report)
    return rc if rc >= 0 else 128 - rc


def _write_report(fd: int | None, report: dict) -> None:
    if fd is not None:
        data = json.dumps(report).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
