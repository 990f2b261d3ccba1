"""A Harbor trial live on podman (``sandbox/podman.py``), on the session's own podman store
(``conftest.podman_store``: btrfs on a loop image, never the host's /var/lib/containers): the
oracle's leftovers reach the verifier as under docker, the environment's root is not the host's
(``--userns=auto``), and what the environment writes outside its binds is capped. Each claim is
checked from the host with the attack that works when the defence is gone. Skipped without root or
podman (scripts/setup.sh installs it).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from polar_testing.harbortask import harbor_task, why
from polar_trial.sandbox import SandboxSpec

pytestmark = pytest.mark.podman


def test_a_podman_trial_built_with_a_service_keeps_the_oracles_server_for_the_verifier(tiny_image, tmp_path,
                                                                                      monkeypatch):
    """One rollout on ``--sandbox podman`` (a task with a RUN step and a compose service; the
    checks share it, as the docker live tests share theirs, to keep CI short):

    - the image is built on podman in a user namespace: the RUN step's uid_map, kept in the image,
      maps 0 to podman's range (as the host's root it read ``0 0 4294967295``), and a file it
      chowned to 1000 is 1000 in the image, not a host uid; ``/`` is 0755 in it (podman's import
      of the flattened build made it 0555);
    - ``web`` (busybox's httpd on 127.0.0.1:8080) joins the main container's network and user
      namespaces (one of its own cannot mount /sys in main's network namespace: "mount sysfs:/sys
      ...: operation not permitted"); main waits for its healthcheck; the verifier reaches it as
      http://web:8080; from the host, before it is removed, its processes map 0 to the trial's
      range, not to the host's root, and it keeps no log;
    - the oracle leaves a web server running (``setsid httpd``); the verifier, in PID and mount
      namespaces of its own in the same environment, reaches it (per-phase containers lost it).

    On the busybox image: a 400 MB python stand-in took 2 x 9 s of ``podman import`` (the
    stand-in, then the flattened build)."""
    import json
    import textwrap

    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset
    from polar_trial.sandbox.podmanroot import AUTO_BASE
    from polar_trial.sandbox.services import Services
    from polar_trial.tasks import load_tasks

    seen: list[tuple[str, dict]] = []
    real_stop = Services.stop

    def inspect_then_stop(self):
        for c in self.containers.values():
            info = json.loads(subprocess.run(["podman", "inspect", c], capture_output=True, text=True).stdout)[0]
            seen.append((Path(f"/proc/{info['State']['Pid']}/uid_map").read_text(), info))
        real_stop(self)

    monkeypatch.setattr(Services, "stop", inspect_then_stop)
    d = harbor_task(tmp_path, "leaves", solve="""
        mkdir -p /srv/www && echo served > /srv/www/marker
        setsid httpd -f -p 127.0.0.1:8000 -h /srv/www >/dev/null 2>&1 < /dev/null &
        for i in $(seq 50); do wget -Y off -q -O /dev/null http://127.0.0.1:8000/marker && break; sleep 0.1; done
        """, test="""
        ok=1
        [ "$(wget -Y off -q -O - http://127.0.0.1:8000/marker)" = served ] || { echo "FAILED: the oracle's server"; ok=0; }
        wget -Y off -q -O - http://web:8080/passwd | grep -q '^root:' || { echo "FAILED: the service web"; ok=0; }
        set -- $(cat /made/uidmap)
        [ "$1" = 0 ] && [ "$2" -ge 1600000000 ] || { echo "FAILED: the build step's uid_map: $*"; ok=0; }
        [ "$(stat -c %u:%g /made/f)" = 1000:1000 ] || { echo "FAILED: /made/f is $(stat -c %u:%g /made/f)"; ok=0; }
        [ "$(stat -c %a /)" = 755 ] || { echo "FAILED: / is $(stat -c %a /)"; ok=0; }
        echo $ok > /logs/verifier/reward.txt
        """, base=tiny_image)
    (d / "environment" / "Dockerfile").write_text(
        f"FROM {tiny_image}\nRUN mkdir /made && cat /proc/self/uid_map > /made/uidmap && echo x > /made/f "
        "&& chown 1000:1000 /made/f\nWORKDIR /app\n")
    (d / "environment" / "docker-compose.yaml").write_text(textwrap.dedent(f"""
        services:
          main:
            depends_on:
              web: {{condition: service_healthy}}
          web:
            image: {tiny_image}
            command: ["httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/etc"]
            healthcheck:
              test: ["CMD", "wget", "-Y", "off", "-q", "-O", "/dev/null", "http://127.0.0.1:8080/passwd"]
              interval: 1s
              retries: 30
        """))
    cfg = r.RolloutConfig(tasks=load_tasks(d, container="podman"), preset=get_preset("oracle"),
                          endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "cap", model="-", samples=1, concurrency=1, timeout=120,
                          settle_s=0.0, sandbox="podman", work_root=tmp_path / "work")
    (row,) = r.run_rollout(cfg).iter_rows(named=True)
    assert row["reward"] == 1.0, why([row])
    notes = row["sandbox_notes"]
    assert "live trial" in notes and "podman --userns=auto" in notes, notes
    (uid_map, info), = seen
    inside, outside, count = uid_map.split()
    assert (inside, count) == ("0", "65536") and int(outside) >= AUTO_BASE, uid_map
    assert f"user namespace: the environment's root is host uid {outside} " in notes, (outside, notes)
    hc = info["HostConfig"]
    assert hc["NetworkMode"].startswith("container:") and hc["LogConfig"]["Type"] == "none", hc


@pytest.fixture(scope="module")
def tiny_image(podman_store, tmp_path_factory) -> str:
    """A 2 MB image: Debian's static busybox, its applets, a passwd. ``--userns=auto`` gives each
    container's range its own copy of the image (a btrfs snapshot chowned file by file: podman
    4.3's btrfs driver has no idmapped mounts), which for the 131 MB debian stand-in cost seconds
    per new range; this one's copy is instant, and the trial's code path is the same."""
    import shutil

    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is not installed (scripts/setup.sh installs busybox-static)")
    root = tmp_path_factory.mktemp("rootfs")
    for d in ("bin", "etc", "tmp", "app", "var", "root", "proc", "dev", "sys", "run"):
        (root / d).mkdir()
    os.chmod(root, 0o755)  # mktemp's 0700: a real image's / is 0755
    os.chmod(root / "tmp", 0o1777)
    shutil.copy(busybox, root / "bin" / "busybox")
    for applet in subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split():
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/nonexistent:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "bin" / "bash").unlink(missing_ok=True)
    (root / "bin" / "bash").write_text('#!/bin/sh\nexec /bin/sh "$@"\n')  # a task's `#!/bin/bash` scripts
    os.chmod(root / "bin" / "bash", 0o755)
    tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "--change", "ENV PATH=/bin", "-", "localhost/polar-test-busybox:1"],
                   stdin=tar.stdout, capture_output=True, check=True)
    assert tar.wait() == 0
    return "localhost/polar-test-busybox:1"


def _agent(trial, work: Path, script: str, **kw):
    spec = SandboxSpec(workdir_host=work, env={"PATH": "/bin"}, timeout_s=60, **kw)
    return trial.view("agent").run(spec, ["sh", "-c", script])


def test_the_environments_root_is_not_the_hosts_seen_from_the_host(tiny_image, tmp_path):
    """Two trials at once. From the host: each environment's processes run as a host uid of
    podman's range (their /proc uid_map maps 0 there), a different one per trial; a file their
    root makes in the work dir is owned by that uid on the host; a host file readable only by the
    host's root, bound in read-only, cannot be read by the container's root for all its
    DAC_OVERRIDE (with the container's root the host's it is read: the attack). The agent holds the
    package manager's capabilities only (bounding and effective), no new privileges, a seccomp
    filter. No container log."""
    from polar_trial.sandbox.podman import PodmanSandbox
    from polar_trial.sandbox.podmanroot import AUTO_BASE, AUTO_COUNT
    from polar_trial.sandbox.trial import PACKAGE_CAPS, LiveTrial, TrialConfig

    secret = tmp_path / "secret"
    secret.write_text("host root only\n")
    os.chmod(secret, 0o600)
    owners = []
    with LiveTrial(PodmanSandbox(), TrialConfig(image=tiny_image, workdir_host=tmp_path / "w0")) as t0, \
         LiveTrial(PodmanSandbox(), TrialConfig(image=tiny_image, workdir_host=tmp_path / "w1")) as t1:
        for i, trial in enumerate((t0, t1)):
            work = tmp_path / f"w{i}"
            res = _agent(trial, work, f"id -u > /app/uid; cat /secret > /app/read 2>/app/err; "
                                      f"setsid sleep 42{i} >/dev/null 2>&1 < /dev/null &",
                         ro_binds=[(secret, "/secret")])
            assert res.returncode == 0, res
            src = trial._workdir_src or work
            assert not (src / "read").read_text() and "Permission denied" in (src / "err").read_text()
            pid = _host_pid_of(f"sleep\x0042{i}")
            status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":\t" in line)
            host_uid = int(status["Uid"].split()[0])
            caps = sum(1 << c for c in PACKAGE_CAPS.values())  # the package manager's, no SYS_ADMIN
            assert int(status["CapEff"], 16) == int(status["CapBnd"], 16) == caps, status
            assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status
            assert (src / "uid").read_text() == "0\n" and os.stat(src / "uid").st_uid == host_uid
            inside, outside, count = Path(f"/proc/{pid}/uid_map").read_text().split()
            assert (inside, count) == ("0", "65536") and int(outside) == host_uid == trial.owner, (host_uid, trial.owner)
            assert AUTO_BASE <= host_uid < AUTO_BASE + AUTO_COUNT
            log = subprocess.run(["podman", "inspect", "--format", "{{.HostConfig.LogConfig.Type}}", trial.name],
                                 capture_output=True, text=True, check=True).stdout.strip()
            assert log == "none", log
            owners.append(host_uid)
    assert owners[0] != owners[1], owners


def test_what_the_environment_writes_outside_its_binds_is_capped(tiny_image, tmp_path):
    """``disk_mb`` 32: the agent writes 100 MiB to /var (the container's own file system, on the
    store's btrfs). podman 4.3 cannot cap it (``--storage-opt size=`` is refused), so the trial
    puts a quota limit on the container's subvolume from the host: the write stops at the cap
    (without it all 100 MiB went through), and the next phase still runs."""
    from polar_trial.sandbox.podman import PodmanSandbox
    from polar_trial.sandbox.trial import LiveTrial, TrialConfig

    work = tmp_path / "w"
    with LiveTrial(PodmanSandbox(), TrialConfig(image=tiny_image, workdir_host=work, disk_mb=32)) as trial:
        res = _agent(trial, work, "dd if=/dev/zero of=/var/big bs=1M count=100 2>/app/dd; echo $? > /app/rc; "
                                  "du -sm /var/big | cut -f1 > /app/mb")
        assert res.returncode == 0, res
        src = trial._workdir_src or work
        assert (src / "rc").read_text().strip() != "0", (src / "dd").read_text()
        assert int((src / "mb").read_text()) <= 32, (src / "mb").read_text()
        assert "quota exceeded" in (src / "dd").read_text().lower(), (src / "dd").read_text()
        after = trial.view("verifier").run(SandboxSpec(workdir_host=work, env={"PATH": "/bin"}, timeout_s=60),
                                           ["true"])
        assert after.returncode == 0, after
        assert any("btrfs quota group" in n for n in res.notes), res.notes


def _host_pid_of(cmdline: str) -> int:
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "cmdline").read_bytes().decode(errors="replace").startswith(cmdline):
                return int(p.name)
        except OSError:
            continue
    raise AssertionError(f"no process {cmdline!r} on the host")



def test_polar_podman_stop_unmounts_a_store_and_frees_its_loop_device(podman_store, tmp_path):
    """``--sandbox podman`` leaves its store mounted for the next run (a loop device of the
    machine's 8); ``polar podman stop`` removes its containers and unmounts it."""
    from typer.testing import CliRunner

    from polar_trial.commands import podman_app
    from polar_trial.sandbox.podmanroot import PodmanRoot

    store = PodmanRoot(tmp_path / "s", data_quota_gb=1)
    store.start(install=False)
    image = str(store.root / "data.img")
    assert any(image in line for line in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines())
    cli = CliRunner()
    status = cli.invoke(podman_app, ["status", "--dir", str(store.root)])
    assert status.exit_code == 0 and "mounted at" in status.output and "0 container(s)" in status.output, status.output
    assert f"CONTAINERS_STORAGE_CONF={store.storage_conf}" in cli.invoke(podman_app, ["env", "--dir", str(store.root)]).output
    stop = cli.invoke(podman_app, ["stop", "--dir", str(store.root)])
    assert stop.exit_code == 0 and "unmounted" in stop.output, stop.output
    assert not store.mounted() and cli.invoke(podman_app, ["status", "--dir", str(store.root)]).exit_code == 1
    assert not any(image in line for line in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines())
