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
import resource
import signal
import socket
import subprocess
import sys
import threading
import time


def _pump(src: socket.socket, dst: socket.socket) -> None:
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


def _serve(listener: socket.socket, unix_path: str) -> None:
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
        b = int(cfg["fsize"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (b, b))
    try:
        proc = subprocess.Popen(argv)
    except OSError as e:
        print(f"sandbox: cannot run {argv[0]!r}: {e}", file=sys.stderr)
        rc = 127
    else:
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        rc = proc.wait()
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
