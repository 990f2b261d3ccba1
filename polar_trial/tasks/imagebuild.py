"""A task's image built for real on a container backend (docker): what a Dockerfile's ``RUN apt-get
install jq`` installs is in the image every later phase runs in.

Before this, the container backend ran each RUN step in a throw-away container of the *base* image
and kept only the work dir, so a package a Dockerfile installed was gone when the oracle ran (a
task whose solution uses ``jq`` failed with ``jq: command not found``). Now:

* each ``RUN`` runs through :meth:`DockerSandbox.run` exactly as before (all capabilities dropped
  but the five a package manager needs to change uid and own files, no new privileges, the
  runtime's seccomp profile, ``--network none``, the package registries reachable only through the
  filtering egress proxy on a job-private socket), on the image the previous step left, and the
  container is then ``docker commit``-ed: its file system outside the bound work dir becomes the
  next layer (binds and the tmpfs /tmp are not committed);
* ``COPY``/``ADD`` and the shorthand's files go into a host staging dir bound at the WORKDIR for
  every RUN (the same hostfs-safe copy as the local mode), which is then ``docker cp``-ed into the
  final image, committed with the Dockerfile's ``WORKDIR`` and ``ENV``;
* the image is tagged ``polar-task/<task>:<Environment.digest()>-<build_inputs_digest()>``: the
  digest of the Dockerfile's steps and every file of the build context, and of our own build
  inputs (``BUILD_INPUTS``: this module, the environment build, the stand-ins; their code, not
  their docstrings: ``polar_core/codedigest.py``), so a change of our build logic or stand-ins
  rebuilds the image instead of reusing one built by the old logic;
* task.toml's ``[environment] docker_image`` is pulled first (``pull_image``: a registry that does
  not answer fails in well under a second here, and is not asked again in the same process); where
  none answers the Dockerfile is built (or, with no Dockerfile, the image's stand-in used), and the
  notes say which. A later build of the same content (a second ``polar
  tasks check``, every sample of a rollout) finds the tag on the daemon and builds nothing
  (``BUILDS`` counts real builds; tests assert on it and on the image id);
* each sample's work dir is the image's WORKDIR, copied out (``docker cp`` as a tar stream,
  every member checked by ``sandbox/safetar.py``, not by the interpreter's filter: no absolute or
  ``..`` member, nothing written through a link, hard links only within the work dir, no device).

Both tar streams go through a pipe, never held whole: a 400 MiB work dir raised Polar's peak RSS
from 121 MiB to 1,319 MiB when the ``docker cp`` tar was built in a BytesIO and its output read
whole. Measured on the private dockerd here, 400 MiB of random data: copying a work dir out raised
the peak RSS by 801 MiB held whole, by 4 MiB streamed (11.0 s -> 5.6 s); copying a tree in, by 402
MiB and 0 MiB (9.3 s -> 3.2 s). The host holds one member header and a 1 MiB chunk
(tests/trial/sandbox/test_safetar.py checks the RSS difference between two work-dir sizes).

``docker build`` was not used: BuildKit's RUN network is the daemon's bridge or the host's (the
private daemon has ``--bridge=none``), and it cannot bind the job-private egress socket, so RUN
steps could reach either nothing or everything. Measured on the 2-core CI machine kind, a
Dockerfile with ``apt-get install -y jq bc`` on the python:3.11 stand-in: see
benchmarks/results/docker_tasks.json (``image_build``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from polar_trial.sandbox.safetar import UnsafeArchive, add_tree, extract
from polar_trial.tasks.model import BuildError

#: real image builds in this process (a warm build, found by its tag, does not count)
BUILDS = 0
#: our own modules whose code an image's content depends on: a change of any rebuilds the image
#: (the build here, the environment's steps, the stand-ins, and the sandbox that runs each RUN
#: step: its user, capabilities, environment and network are in what a step leaves)
BUILD_INPUTS = tuple(Path(__file__).resolve().parents[1] / p for p in (
    "tasks/imagebuild.py", "tasks/environment.py", "sandbox/standin.py", "sandbox/releasestandin.py",
    "sandbox/uvstandin.py", "sandbox/docker.py", "sandbox/_init.py", "sandbox/egress.py"))
#: how long a registry may take to answer a pull (its first line of output): a host that does not
#: resolve fails in ~0.1 s here (measured: ``docker pull python:3.11-slim`` on the private daemon,
#: "lookup registry-1.docker.io ... no such host"), one that drops packets would hang for the
#: daemon's own timeouts; a pull that has started may take ``PULL_TOTAL_S`` (a big image)
PULL_ANSWER_S = 20.0
PULL_TOTAL_S = 1800.0
#: the label of a task image that says whether task.toml's docker_image was pulled or the
#: Dockerfile built instead (said again when the image is reused)
SOURCE_LABEL = "org.polar.task-image.source"
#: registry host -> why it did not answer (not asked again in this process)
_UNREACHABLE: dict[str, str] = {}
_lock = threading.Lock()
REPOSITORY = "polar-task"


def task_image(task: Any, sandbox: Any) -> str | None:
    """The image every phase of ``task`` runs in under ``sandbox``: its built image on a backend that
    builds images (docker, podman), else the Dockerfile's FROM image as it is."""
    if not getattr(sandbox, "builds_images", False) or not task.image:
        return task.image
    return image_tag(task)


def build_inputs_digest() -> str:
    """The digest of :data:`BUILD_INPUTS`' code (docstrings and comments left out)."""
    from polar_core.codedigest import code_digest

    return code_digest(*BUILD_INPUTS)


def image_tag(task: Any) -> str:
    """``polar-task/<slug of the task id>:<digest of the build's content>-<digest of our build inputs>``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", task.id.lower()).strip("-._")[:80] or "task"
    return f"{REPOSITORY}/{slug}:{task.environment.digest()}-{build_inputs_digest()}"


def registry_host(image: str) -> str:
    """The registry an image name pulls from (``docker.io`` for a bare ``python:3.11``)."""
    first, _, rest = image.partition("/")
    return first if rest and ("." in first or ":" in first or first == "localhost") else "docker.io"


def pull_image(image: str, runtime: str = "docker", answer_s: float = PULL_ANSWER_S,
               total_s: float = PULL_TOTAL_S) -> tuple[bool, str]:
    """``docker pull image``: (pulled, why not). The registry must answer (the pull prints its first
    line) within ``answer_s``; a pull that has started may take ``total_s``. A registry that did not
    answer is not asked again in this process (a dataset naming images on one unreachable registry
    pays once)."""
    host = registry_host(image)
    if host in _UNREACHABLE:
        return False, f"{host} did not answer earlier in this run: {_UNREACHABLE[host]}"
    proc = subprocess.Popen([runtime, "pull", image], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace")
    lines: list[str] = []
    answered = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip())
            answered.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0 = time.monotonic()
    while not answered.is_set() and proc.poll() is None and time.monotonic() - t0 < answer_s:
        answered.wait(0.05)
    try:
        if not answered.is_set() and proc.poll() is None:
            _UNREACHABLE[host] = f"no answer within {answer_s:g} s"
            return False, _UNREACHABLE[host]
        proc.wait(timeout=total_s)
    except subprocess.TimeoutExpired:
        return False, f"the pull took over {total_s:g} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    if proc.returncode == 0:
        return True, ""
    why = (lines[-1:] or [f"exit {proc.returncode}"])[0][:300]
    if re.search(r"dial tcp|no such host|i/o timeout|connection refused|TLS handshake|network is unreachable", why):
        _UNREACHABLE[host] = why
    return False, why


def _docker(runtime: str, *args: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    if "input" not in kw:
        kw["stdin"] = subprocess.DEVNULL
    r = subprocess.run([runtime, *args], capture_output=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        err = r.stderr.decode(errors="replace") if isinstance(r.stderr, bytes) else r.stderr
        raise RuntimeError(f"`{runtime} {' '.join(args[:3])}` failed: {err.strip()[-600:]}")
    return r


def _label(image: str, label: str, runtime: str = "docker") -> str | None:
    r = _docker(runtime, "image", "inspect", "--format", "{{index .Config.Labels \"%s\"}}" % label, image,
                check=False, text=True)
    val = r.stdout.strip() if r.returncode == 0 else ""
    return val if val and val != "<no value>" else None


def image_id(image: str, runtime: str = "docker") -> str | None:
    r = _docker(runtime, "image", "inspect", "--format", "{{.Id}}", image, check=False, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def build_task_image(task: Any, sandbox: Any, log_dir: Path, apply_steps: Callable[..., list[str]]) -> tuple[str, list[str]]:
    """The task's image (built, or found by its content tag); returns (tag, notes). Raises
    ``BuildError`` naming the Dockerfile line. ``apply_steps``: ``environment.apply_steps`` (passed
    in: the environment module calls this one)."""
    global BUILDS
    tag, runtime = image_tag(task), sandbox.runtime
    if image_id(tag, runtime):  # what its build said of docker_image, said again
        try:
            said = [str(n) for n in json.loads(_label(tag, SOURCE_LABEL, runtime) or "[]")]
        except (ValueError, TypeError):
            said = []
        return tag, list(task.environment.notes) + said + [f"image {tag} reused (built before from the same content)"]
    base, pulled, said = task.image, False, []
    want = task.environment.pull  # task.toml's docker_image: pulled where a registry answers
    if want:
        pulled, why = pull_image(want, runtime)
        if pulled:
            base = want
            said.append(f"[environment] docker_image {want} pulled: it is the task's image "
                        "(environment/Dockerfile not built)")
        else:
            said.append(f"[environment] docker_image {want} not pulled ({why}): "
                        + ("environment/Dockerfile built instead" if task.environment.context is not None
                           else "no Dockerfile, so the image's stand-in is used where Polar has one"))
    if not base:
        raise BuildError(f"the {runtime} backend needs the Dockerfile's FROM image")
    if not pulled:
        sandbox.image_ready(base)  # stood in where missing
    t0 = time.monotonic()
    created: list[str] = []  # intermediate images, removed at the end
    state = {"image": base}

    def next_tag() -> str:
        return f"{REPOSITORY}-step/{os.getpid()}-{len(created)}-{time.monotonic_ns() % 10**9}:tmp"

    def run_step(spec: Any, argv: list[str], out: Any) -> Any:
        spec.image = state["image"]
        uv_stand_in(spec, argv[-1], notes_extra)
        release_stand_in(spec, argv[-1], notes_extra)
        nxt = next_tag()
        res = sandbox.run(spec, argv, stdout=out, stderr=out, commit_to=nxt)
        if res.returncode == 0 and not res.timed_out:
            created.append(nxt)
            state["image"] = nxt
        return res

    def copy_in(root: Path) -> None:
        """A COPY outside the work dir: ``root``'s tree into / of the image so far, committed."""
        cid = _docker(runtime, "create", "--entrypoint", "true", state["image"], text=True).stdout.strip()
        try:
            tar_into(runtime, cid, [(child, child.name) for child in sorted(root.iterdir())])
            nxt = next_tag()
            _docker(runtime, "commit", cid, nxt)
            created.append(nxt)
            state["image"] = nxt
        finally:
            _docker(runtime, "rm", "-f", cid, check=False)

    stage = Path(tempfile.mkdtemp(prefix="polar-stage-"))
    notes_extra: list[str] = []
    try:
        (stage / "work").mkdir(parents=True, exist_ok=True)  # the pulled image's work dir, as it has it
        notes = said + (list(task.environment.notes) if pulled else
                        apply_steps(task, stage / "work", sandbox, log_dir, run_step=run_step, copy_in=copy_in))
        notes += list(dict.fromkeys(notes_extra))
        changes = image_changes(base, runtime) + [f"WORKDIR {task.workdir}"] + [
            f"ENV {k}={v}" for k, v in task.environment.env.items()] + (
            [f"LABEL {SOURCE_LABEL}={json.dumps(json.dumps(said))}"] if said else [])
        cid = _docker(runtime, "create", "--entrypoint", "true", state["image"], text=True).stdout.strip()
        try:
            # the staging dir's contents at WORKDIR (links added as links, never followed; the
            # daemon creates missing parents)
            tar_into(runtime, cid, [(stage / "work", task.workdir.strip("/"))])
            flatten(runtime, cid, tag, changes)
        finally:
            _docker(runtime, "rm", "-f", cid, check=False)
    except BuildError:
        raise
    except RuntimeError as exc:  # a docker command (SandboxError: a commit) failed
        raise BuildError(f"building the image {tag}: {exc}") from exc
    finally:
        for img in reversed(created):  # the newest first: each is the previous one's child
            _docker(runtime, "rmi", img, check=False)
        import shutil

        shutil.rmtree(stage, ignore_errors=True)
    with _lock:
        BUILDS += 1
    return tag, notes + [f"image {tag} built from {base} in {time.monotonic() - t0:.1f} s "
                         f"({0 if pulled else sum(1 for s in task.environment.steps if s.kind == 'run')} RUN "
                         "step(s) committed)"]


def uv_stand_in(spec: Any, command: str, notes: list[str]) -> None:
    """A RUN step that pipes astral's uv installer into sh (``curl -LsSf
    https://astral.sh/uv/0.5.11/install.sh | sh``, as Terminal-Bench-style Dockerfiles do) gets the
    verifier's local installer of that uv (``sandbox/uvstandin.py``), said in the build's notes."""
    from polar_trial.sandbox.uvstandin import MOUNT, UvStandInError, verifier_binds

    try:
        binds, said = verifier_binds(command)
    except UvStandInError as exc:
        notes.append(f"no local uv installer: {exc}")
        return
    _bind_tools(spec, MOUNT, binds, said, notes)


def release_stand_in(spec: Any, command: str, notes: list[str]) -> None:
    """A RUN step that downloads a GitHub release archive an npm package republishes (the Kotlin
    compiler's zip) gets it from that package (``sandbox/releasestandin.py``), said in the notes."""
    from polar_trial.sandbox.releasestandin import MOUNT, ReleaseStandInError, build_binds

    try:
        binds, said = build_binds(command, env=spec.env)
    except ReleaseStandInError as exc:
        notes.append(f"no local release archive: {exc}")
        return
    _bind_tools(spec, MOUNT, binds, said, notes)


def _bind_tools(spec: Any, mount: str, binds: list, said: list[str], notes: list[str]) -> None:
    """A stand-in's binds added to the step, its ``bin`` first on PATH, what it says in the notes."""
    if binds:
        spec.ro_binds = list(spec.ro_binds) + binds
        spec.env = {**spec.env, "PATH": f"{mount}/bin:{spec.env.get('PATH', '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin')}"}
        notes += said


def image_changes(base: str, runtime: str = "docker") -> list[str]:
    """The base image's config (ENV, LABEL, CMD, ENTRYPOINT, USER) as ``--change`` lines: the built
    image starts from it, not from a build container's config (whose env held the egress proxy's
    address, HOME=/root, DEBIAN_FRONTEND: a RUN step's environment is not the image's)."""
    r = _docker(runtime, "image", "inspect", "--format", "{{json .Config}}", base, text=True)
    cfg = json.loads(r.stdout) or {}
    out = [f"ENV {e}" for e in cfg.get("Env") or [] if "=" in e]
    out += [f"LABEL {k}={json.dumps(v)}" for k, v in (cfg.get("Labels") or {}).items()]
    for key, field in (("CMD", "Cmd"), ("ENTRYPOINT", "Entrypoint")):
        if cfg.get(field):
            out.append(f"{key} {json.dumps(cfg[field])}")
    if cfg.get("User"):
        out.append(f"USER {cfg['User']}")
    return out


def flatten(runtime: str, cid: str, tag: str, changes: list[str]) -> None:
    """``docker export`` of the container piped into ``docker import`` with ``changes``: one layer,
    and a config that is exactly the base's plus the Dockerfile's. The stream is given an entry for
    ``/`` itself first (0755, root's), which the export leaves out: podman 4.3's import then made
    ``/`` 0555 (measured), where a root without capabilities (an agent denied them) could not make
    a directory as it can under docker."""
    import shutil

    exp = subprocess.Popen([runtime, "export", cid], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           stdin=subprocess.DEVNULL)
    with tempfile.TemporaryFile() as imp_err:
        imp = subprocess.Popen([runtime, "import", *(a for c in changes for a in ("--change", c)), "-", tag],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=imp_err)

        def feed() -> None:
            try:
                imp.stdin.write(_root_entry())  # type: ignore[union-attr]
                shutil.copyfileobj(exp.stdout, imp.stdin, 1 << 20)  # type: ignore[arg-type]
            except (BrokenPipeError, ValueError):
                pass  # import stopped reading: its error is said below
            finally:
                with contextlib.suppress(OSError):
                    imp.stdin.close()  # type: ignore[union-attr]

        feeder = threading.Thread(target=feed, name="flatten", daemon=True)
        feeder.start()
        try:
            imp.wait(timeout=600)
        except subprocess.TimeoutExpired:
            imp.kill()
            imp.wait()
        finally:
            exp.stdout.close()  # type: ignore[union-attr]
            exp_err = exp.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
            exp.wait(timeout=60)
            feeder.join(60)
        imp_err.seek(0)
        err = imp_err.read().decode(errors="replace")
    if exp.returncode != 0 or imp.returncode != 0:
        raise RuntimeError(f"export/import into {tag} failed: {(exp_err + err).strip()[-600:]}")


def _root_entry() -> bytes:
    """A tar header for ``./``: a directory, 0755, uid and gid 0."""
    info = tarfile.TarInfo("./")
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
    return info.tobuf(format=tarfile.PAX_FORMAT)


def tar_into(runtime: str, cid: str, trees: list[tuple[Path, str]]) -> None:
    """The host trees ``(path, name in the container)`` streamed into ``cid:/`` through ``docker cp
    -`` (links added as links, never followed; no special file), in constant memory."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([runtime, "cp", "-", f"{cid}:/"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            try:
                with tarfile.open(fileobj=proc.stdin, mode="w|") as tf:
                    for path, name in trees:
                        add_tree(tf, path, name)
            except BrokenPipeError:
                pass  # docker cp stopped reading: its error is said below
            finally:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # type: ignore[union-attr]
            rc = proc.wait(timeout=300)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if rc != 0:
            err.seek(0)
            raise RuntimeError(f"`{runtime} cp` into the build container failed: "
                               f"{err.read()[-600:].decode(errors='replace').strip()}")


#: the most a work dir copied out of an image may hold (apparent size: a task's 1 TB sparse file is
#: refused from its header, before a byte of it is streamed)
EXPORT_LIMIT = 32 * 2**30


def export_workdir(image: str, workdir: str, dest: Path, runtime: str = "docker") -> list[str]:
    """The image's ``workdir`` copied out into ``dest`` (emptied first), safely and streamed
    (module docstring); returns notes (special files left out)."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    cid = _docker(runtime, "create", "--entrypoint", "true", image, text=True).stdout.strip()
    try:
        with tempfile.TemporaryFile() as err:
            # entries named <basename of workdir>/...: strip=1
            proc = subprocess.Popen([runtime, "cp", f"{cid}:{workdir}", "-"], stdout=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, stderr=err)
            try:
                with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
                    got = extract(tf, dest, strip=1, symlinks="keep", max_bytes=EXPORT_LIMIT)
                for _ in range(16):  # the archive's end padding, if any: docker cp must not block on it
                    if not proc.stdout.read(1 << 16):  # type: ignore[union-attr]
                        break
                rc = proc.wait(timeout=300)
            except (tarfile.TarError, UnsafeArchive, OSError) as exc:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"copying {workdir} out of {image}: {exc}") from exc
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            finally:
                proc.stdout.close()  # type: ignore[union-attr]
            if rc != 0:
                err.seek(0)
                raise RuntimeError(f"copying {workdir} out of {image}: `{runtime} cp` failed: "
                                   f"{err.read()[-600:].decode(errors='replace').strip()}")
    finally:
        _docker(runtime, "rm", "-f", cid, check=False)
    os.chmod(dest, 0o755)
    return got.notes()
