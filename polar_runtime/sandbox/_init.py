"""The first process inside a bubblewrap sandbox (run by the host's /usr/bin/python3, stdlib only;
copied into the job-private directory, so nothing of the repository is visible inside).

    python3 /run/polar-sandbox/init.py CONFIG_JSON -- ARGV...

It (1) relays 127.0.0.1:<proxy port> inside the sandbox's own network namespace to the job-private
Unix socket the host relays on to the model proxy, so HTTPS_PROXY and base-URL harnesses work
unchanged with no network; (2) sets RLIMIT_FSIZE; (3) runs ARGV as its child and waits for it;
(4) then counts and SIGKILLs whatever the command left running (bwrap's PID 1 would end them
silently when this process exits; counting them first lets the sample's record say so), and
writes a JSON report to the fd the host passed (not inherited by ARGV).
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


def _spawn_and_wait(argv: list[str]) -> int:
    """Run argv as a child (PATH searched in the phase's env); its status, -N if killed by N."""
    r, w = os.pipe()  # the child reports a failed exec through it (closed on a good one)
    os.set_inheritable(w, False)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(w, f"{e}".encode())
        os._exit(127)
    os.close(w)
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


def main() -> int:
    cfg = json.loads(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    report_fd = cfg.get("report_fd")
    if report_fd is not None:
        os.set_inheritable(report_fd, False)
    report: dict = {"relay": None, "leftovers": 0}
    if cfg.get("proxy_port"):
        try:
            _relay(int(cfg["proxy_port"]), cfg["socket"])
            report["relay"] = True
        except OSError as e:
            report["relay"] = f"{e}"
    if cfg.get("fsize"):
        import resource

        b = int(cfg["fsize"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (b, b))
    rc = _spawn_and_wait(argv)
    me = os.getpid()
    seen: set[int] = set()
    # Sweep only inside a PID namespace of its own (this process is then the child of the
    # namespace's PID 1): anywhere else "every other process" would be the host's.
    own_namespace = os.getppid() == 1
    report["swept"] = own_namespace
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
