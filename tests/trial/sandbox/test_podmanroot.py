"""The podman backend's parts that need no podman (``podmanroot.py``, ``podman.py``): the store's
configuration, how a container's root is read, and that checking the backend sets nothing up. The
live checks are in ``test_podman_live.py``."""

from __future__ import annotations

import json
import os
import resource
import tomllib

import pytest

from polar_trial.sandbox import SandboxError, get_sandbox
from polar_trial.sandbox import podman as podman_mod
from polar_trial.sandbox.podman import PodmanSandbox, container_root
from polar_trial.sandbox.podmanroot import AUTO_USER, CONTAINER_IDS, PODMAN_NPROC, PodmanRoot


def test_the_store_is_ours_with_runc_no_logs_its_own_range_and_ulimits_the_caller_can_hand_on(tmp_path):
    """Each line is a failure measured on podman 4.3.1 here without it: the host's store, crun
    refusing hybrid cgroups, runc's setrlimit EPERM above the caller's hard limits (podman lowers
    its own nproc to 32768 first), a container log growing with the phase's output."""
    store = PodmanRoot(tmp_path / "p")
    storage, containers = (tomllib.loads(t) for t in store.configs())
    assert storage["storage"]["driver"] == "btrfs"
    assert storage["storage"]["graphroot"] == str(tmp_path / "p" / "data" / "storage")
    assert storage["storage"]["runroot"].startswith("/run/polar/podman-")
    opts = storage["storage"]["options"]
    assert opts["root-auto-userns-user"] == AUTO_USER
    assert opts["auto-userns-min-size"] == opts["auto-userns-max-size"] == CONTAINER_IDS
    assert containers["engine"]["runtime"] == "runc" and containers["engine"]["events_logger"] == "none"
    assert containers["containers"]["log_driver"] == "none"
    limits = dict(u.split("=") for u in containers["containers"]["default_ulimits"])
    nofile, nproc = (int(limits[k].split(":")[1]) for k in ("nofile", "nproc"))
    hard_nofile, hard_nproc = (resource.getrlimit(r)[1] for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC))
    assert nofile <= hard_nofile or hard_nofile == resource.RLIM_INFINITY
    assert nproc <= min(PODMAN_NPROC, hard_nproc if hard_nproc != resource.RLIM_INFINITY else PODMAN_NPROC)
    assert store.env() == {"CONTAINERS_STORAGE_CONF": str(store.storage_conf),
                           "CONTAINERS_CONF": str(store.containers_conf)}


def _fake_podman(tmp_path, monkeypatch, maps: dict) -> None:
    """A ``podman`` first on PATH that answers ``inspect`` with ``maps`` as IDMappings."""
    bin_dir = tmp_path / f"bin{len(list(tmp_path.glob('bin*')))}"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text(f"#!/bin/sh\necho '{json.dumps(maps)}'\n")
    os.chmod(bin_dir / "podman", 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_a_containers_root_is_the_first_host_id_of_its_maps_and_one_without_a_namespace_is_refused(tmp_path, monkeypatch):
    """The owner the trial chowns the work dir to: never the host's root (``--userns=host`` gives no
    maps; a map of 0 to 0 is the host's ids)."""
    _fake_podman(tmp_path, monkeypatch, {"UidMap": ["0:1600065536:65536"], "GidMap": ["0:1600065536:65536"]})
    assert container_root("c") == 1600065536
    _fake_podman(tmp_path, monkeypatch, {"UidMap": None, "GidMap": None})
    with pytest.raises(SandboxError, match="not in a user namespace of its own"):
        container_root("c")
    _fake_podman(tmp_path, monkeypatch, {"UidMap": ["0:0:4294967295"], "GidMap": ["0:0:4294967295"]})
    with pytest.raises(SandboxError, match="maps to host uid 0"):
        container_root("c")


def test_checking_the_backend_sets_nothing_up_and_opening_it_does(monkeypatch):
    """Test modules call ``available()`` at collection: as root with no store named, the check must
    not make one (it would mount a loop image for good) nor run ``podman info`` (the host's store);
    ``get_sandbox("podman")`` makes Polar's."""
    made = []
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv("CONTAINERS_STORAGE_CONF", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(podman_mod, "use_private_root", lambda: made.append(1))
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail(f"ran {a[0]}"))
    assert PodmanSandbox.unavailable_reason() is None and made == []
    assert isinstance(get_sandbox("podman"), PodmanSandbox) and made == [1]
