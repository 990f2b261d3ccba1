"""The first process inside a bubblewrap sandbox (run by the host's /usr/bin/python3, stdlib only;
copied into the job-private directory, so nothing of the repository is visible inside).

    python3 /run/polar-sandbox/init.py CONFIG_JSON -- ARGV...

It (1) relays 127.0.0.1:<proxy port> inside the sandbox's own network namespace to the job-private
Unix socket the host relays on to the model proxy, so HTTPS_PROXY and base-URL harnesses work
unchanged with no network; (2) sets RLIMIT_FSIZE; (3) runs ARGV as its child and waits for it;
(4) then counts and SIGKILLs whatever the command left running (bwrap's PID 1 would end them
silently when this process exits; counting them first lets the sample's record say so), and
writes a JSON report to the fd the host passed (not inherited by ARGV).

Environment: this init runs with the host's fixed minimal one (``bubblewrap.HOST_ENV``); the
phase's (``env_file`` in the config, 0600 in the job-private dir) is read here and given to ARGV's
execve only, after the drop: a task's LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, GCONV_PATH or LOCPATH
is never in a process that holds a privilege. Without ``env_file`` (the container backends) ARGV
gets this process's own environment.

Privilege (a root caller): bwrap itself runs as the host's root, so that its binds reach any path,
and hands this init only CAP_SETUID and CAP_SETGID (to move its child, then itself, to
unprivileged uids; no mount, no map writing: CAP_SYS_ADMIN and CAP_SETFCAP stay with the host).
The child that becomes ARGV first becomes the unprivileged host uid, then enters a user and mount
namespace of its own (that uid's), whose uid/gid 0..65535 the *host* maps to that host range
(``uid_base``; ``uidrange.MapWriter``): ARGV is uid 0 *inside* (apt, Harbor tasks) and holds
capabilities only over its own namespaces; on the host it is an unused uid with none. Its copies
of the mounts are locked by the kernel (a read-only bind cannot be remounted writable, a cover
such as bwrap's read-only /proc/sys cannot be unmounted). Then ``no_new_privs`` and a seccomp
filter that refuses with EPERM what no task needs: mounting, the kernel keyrings,
``open_by_handle_at``, kernel modules, bpf, kexec, swap, clock and reboot calls, and every call
of another ABI (x32, i386). A caller that is not root is already unprivileged (bwrap gives it a
user namespace of its own): only no_new_privs and the filter are added.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# socket/threading (the relay) and resource are imported only when needed, and the child is
# started with fork/exec rather than subprocess: Python's start-up is most of a sandbox's
# (bwrap alone: ~15 ms; python3 -I -S: ~25 ms more)


def _pump(src, dst) -> None:
    import socket

    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _serve(listener, unix_path: str) -> None:
    import socket
    import threading

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.connect(unix_path)
        except OSError:
            conn.close()
            continue
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _relay(port: int, unix_path: str) -> None:
    import socket
    import threading

    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(64)
    threading.Thread(target=_serve, args=(ls, unix_path), daemon=True).start()


def _leftovers(me: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            try:
                with open(f"/proc/{name}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue  # already dead, waiting for PID 1 to reap it
            except (OSError, IndexError):
                continue
            out.append(int(name))
    return out


# ---- privilege: user namespace, no_new_privs, seccomp --------------------------------------------

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_CAPBSET_DROP = 38, 22, 2, 24
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
#: (audit arch, syscall numbers refused); mount family, keyrings, handles, modules, bpf, kexec,
#: swap, reboot, clocks, acct, quotactl, syslog, perf_event_open
SYSCALLS = {
    "x86_64": (0xC000003E, (165, 166, 155, 428, 429, 430, 431, 432, 433, 442,  # mount .. mount_setattr
                            248, 249, 250, 303, 304, 175, 176, 313, 321, 246, 320,  # keys, handles, modules, bpf, kexec
                            167, 168, 169, 164, 227, 305, 159, 163, 179, 103, 298, 172, 173)),
    "aarch64": (0xC00000B7, (40, 39, 41, 428, 429, 430, 431, 432, 433, 442,
                             217, 218, 219, 264, 265, 105, 106, 273, 280, 104, 294,
                             224, 225, 142, 170, 112, 266, 171, 89, 60, 116, 241)),
}


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(ctypes, ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _seccomp_program(machine: str) -> bytes:
    """A classic-BPF filter: another ABI or a refused call -> EPERM, anything else allowed."""
    import struct

    arch, numbers = SYSCALLS[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    n = len(numbers)
    prog = [op(ld, 4)]  # seccomp_data.arch
    extra = 1 if machine == "x86_64" else 0  # x32 ABI: numbers with bit 30 set
    prog.append(op(jeq, arch, 0, 2 + extra + n))  # other arch -> deny
    prog.append(op(ld, 0))  # seccomp_data.nr
    if extra:
        prog.append(op(jge, 0x40000000, n + 1, 0))
    for i, nr in enumerate(numbers):
        prog.append(op(jeq, nr, n - i, 0))
    prog.append(op(ret, SECCOMP_RET_ALLOW))
    prog.append(op(ret, SECCOMP_RET_ERRNO | EPERM))
    return b"".join(prog)


def _no_new_privs_and_seccomp() -> None:
    import platform

    ctypes, libc = _libc()
    _check(ctypes, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    machine = platform.machine()
    if machine not in SYSCALLS:
        raise OSError(f"no seccomp filter for {machine}")
    code = _seccomp_program(machine)
    buf = ctypes.create_string_buffer(code, len(code))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(ctypes, libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _enter_user_namespace(map_fd: int, host_uid: int) -> None:
    """In the child: first the unprivileged host uid (so the new user namespace is *its*, and the
    kernel charges what the phase uses, inotify instances, namespaces, to that uid, not to the
    host's root), then a user + mount namespace of its own; the host writes the uid/gid maps
    (asked over ``map_fd``, a Unix socket whose peer learns this process's pid and uid from the
    kernel: ``uidrange.MapWriter``); then uid/gid 0 inside, no supplementary groups."""
    ctypes, libc = _libc()
    os.setgroups([])
    os.setresgid(host_uid, host_uid, host_uid)
    os.setresuid(host_uid, host_uid, host_uid)
    _check(ctypes, libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user, mount)")
    os.write(map_fd, b"u")
    if os.read(map_fd, 1) != b"m":
        raise OSError("the host could not map the sandbox's user ids")
    os.close(map_fd)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def _drop_all_capabilities(keep: tuple[int, ...] = ()) -> None:
    """Empty the bounding set (so exec as uid 0 regains nothing) and the other sets: the phase
    holds no capability even over its own namespaces. ``keep``: capabilities (numbers below 32)
    left in the bounding, effective and permitted sets."""
    ctypes, libc = _libc()
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    for cap in range(last + 1):
        if cap not in keep:
            _check(ctypes, libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    mask = sum(1 << c for c in keep)
    # two of {effective, permitted, inheritable} (low 32 bits, then high): no inheritable, so no ambient
    data = (ctypes.c_uint32 * 6)(mask, mask, 0, 0, 0, 0)
    _check(ctypes, libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")


def _phase_env(path: str | None) -> dict[str, str]:
    """The phase's environment from ``path`` (a JSON object of strings), or this process's own."""
    if not path:
        return dict(os.environ)
    with open(path, "rb") as fh:
        env = json.load(fh)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{path}: not an object of strings")
    if "PWD" in os.environ:  # what bwrap's --chdir set, as the phase always had it
        env.setdefault("PWD", os.environ["PWD"])
    return env


def _spawn_and_wait(argv: list[str], drop: dict | None = None, harden: bool = False,
                    env: dict[str, str] | None = None) -> int:
    """Run argv as a child with ``env`` (None: this process's; PATH searched in it); its status,
    -N if killed by N. ``drop`` ({"uid_base", "map_fd", "init_uid"}): the child enters a user
    namespace of its own, which the host maps to that host range; ``harden``: no_new_privs and
    the seccomp filter before exec."""
    r, w = os.pipe()  # the child reports a failed exec through it (closed on a good one)
    os.set_inheritable(w, False)
    if drop:
        os.set_inheritable(int(drop["map_fd"]), False)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            # Python ignores SIGPIPE and an ignored signal stays ignored across exec: the phase
            # gets it back as on any system (`curl ... | sh`, `yes | head` end as they would)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            if drop:
                _enter_user_namespace(int(drop["map_fd"]), int(drop["uid_base"]))
                if not drop.get("keep_caps"):
                    _drop_all_capabilities()
            if harden:
                _no_new_privs_and_seccomp()
            os.execvpe(argv[0], argv, os.environ if env is None else env)
        except BaseException as e:  # noqa: BLE001 - never back into the init's code (a NUL in the env: ValueError)
            os.write(w, f"{e}".encode())
        os._exit(127)
    os.close(w)
    if drop:
        os.close(int(drop["map_fd"]))
        # This init needs no privilege from here on: an unprivileged uid of its own (not the
        # phase's, so neither can signal or trace the other); the kernel clears every capability.
        init_uid = int(drop["init_uid"])
        os.setgroups([])
        os.setresgid(init_uid, init_uid, init_uid)
        os.setresuid(init_uid, init_uid, init_uid)
    err = os.read(r, 4096)
    os.close(r)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if err:
        print(f"sandbox: cannot run {argv[0]!r}: {err.decode(errors='replace')}", file=sys.stderr)
    return os.waitstatus_to_exitcode(status)


def _copy_home(home_cfg: dict, env: dict[str, str], argv: list[str]) -> tuple[dict[str, str], list[str], str]:
    """A per-phase container: the harness's HOME (bound read-only at ``home_cfg["src"]``) copied
    into this uid's HOME from the image's /etc/passwd, and the phase's paths moved there
    (``_homeinit.py``, copied beside this file). The HOME, for the host's read-back."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import homeinit

    home = homeinit.passwd_home(os.getuid())
    try:
        files = homeinit.read_tree(home_cfg["src"])
        homeinit.ensure_home(home, os.getuid(), os.getgid())
        problems = homeinit.write_tree(home, files)
    except OSError as e:
        problems = [f"the harness's HOME could not be copied into {home}: {e}"]
    for p in problems:
        print(f"sandbox: {p}", file=sys.stderr)
    env, argv = homeinit.rewrite(env, argv, home_cfg["prefix"], home)
    return env, argv, home


#: What a root caller's init keeps until its child is the range's uid (bwrap also gives it
#: CAP_SETPCAP, to drop the rest here: bwrap leaves the bounding set whole, and uid 0 regains at
#: execve every capability the bounding set holds, whatever is effective now)
CAP_SETGID, CAP_SETUID = 6, 7


def main() -> int:
    cfg = json.loads(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    if cfg.get("drop"):
        _drop_all_capabilities(keep=(CAP_SETGID, CAP_SETUID))
    report_fd = cfg.get("report_fd")
    if report_fd is not None:
        os.set_inheritable(report_fd, False)
    report: dict = {"relay": None, "leftovers": 0}
    relays = [(cfg["proxy_port"], cfg["socket"])] if cfg.get("proxy_port") else []
    relays += [tuple(r) for r in cfg.get("relays", [])]  # the registries' filtering proxy
    for port, path in relays:
        try:
            _relay(int(port), path)
            report["relay"] = True
        except OSError as e:
            report["relay"] = f"{e}"
    if cfg.get("fsize"):
        import resource

        b = int(cfg["fsize"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (b, b))
    for src, dest in cfg.get("copy_in", []):  # uploaded, not mounted (docker.py: COPIED_IN)
        import shutil

        try:
            shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
        except OSError as e:
            print(f"sandbox: copying {src} to {dest} failed: {e}", file=sys.stderr)
    try:
        env = _phase_env(cfg.get("env_file"))
    except (OSError, ValueError) as e:
        print(f"sandbox: cannot read the phase's environment: {e}", file=sys.stderr)
        return 125
    if cfg.get("home"):  # a container backend: the harness's HOME into this uid's own
        env, argv, report["home"] = _copy_home(cfg["home"], env, argv)
    rc = _spawn_and_wait(argv, cfg.get("drop"), bool(cfg.get("harden")), env)
    me = os.getpid()
    seen: set[int] = set()
    # Sweep only inside a PID namespace of its own (this process is then the child of the
    # namespace's PID 1): anywhere else "every other process" would be the host's.
    own_namespace = os.getppid() == 1
    report["swept"] = own_namespace
    if cfg.get("drop") and own_namespace:
        # Unprivileged now, this init cannot kill the phase's processes: it counts them, and
        # they end with the PID namespace when it exits (the kernel kills every process left).
        seen.update(_leftovers(me))
        own_namespace = False
    for _ in range(100 if own_namespace else 0):  # a fork bomb keeps forking while we kill: until none is left
        left = _leftovers(me)
        if not left:
            break
        for pid in left:
            seen.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    report["leftovers"] = len(seen)
    report["returncode"] = rc
    if report_fd is not None:
        try:
            os.write(report_fd, json.dumps(report).encode())
            os.close(report_fd)
        except OSError:
            pass
    elif cfg.get("report_path"):  # container backends: no fd crosses the runtime
        try:
            with open(cfg["report_path"], "w") as fh:
                json.dump(report, fh)
        except OSError:
            pass
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
