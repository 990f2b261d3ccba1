"""``polar cluster gather``: every node's captures, copied through Ray into ``DIR/<node id>/``.

Captures stay on the node that made them while a run goes on (the proxy appends to local files;
nothing crosses the network per call). Afterwards, :func:`gather` runs one short Ray task pinned to
each live node (hard node affinity; the loop's node agents are gone by then, so the task is the
node's agent for this job) in two rounds:

1. each node lists the node directories it can see under ``node_dir``: its own, and those of nodes
   that are no longer alive when its disk holds them (one machine, or a shared file system);
2. each node directory is archived (tar, streamed in chunks as Ray objects) by exactly one node
   that sees it, its own node first, and unpacked into ``DIR/<node id>/``.

A lost node's directory that no live node can see is reported ``unreachable``, never silently
missing. What is copied: ``captures/`` (sessions, flows, per-sample results; the harnesses' work
dirs are left behind) into ``DIR/<node id>/``, and the node's ``logs/`` into ``DIR/<node id>/node-logs/``.
``DIR/gather.json`` says, per node, how many files and bytes came, through which node, and whether
the node was lost.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Iterator

CHUNK = 8 * 2**20  # bytes per streamed piece of an archive
SKIP = {"work"}  # the harnesses' work dirs (copies of the task's files, the agent's scratch)


def visible_node_dirs(node_dir: str) -> list[str]:
    """Node ids whose directory is under ``node_dir`` on this machine."""
    root = Path(node_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "captures").is_dir())


def _members(root: Path) -> Iterator[tuple[Path, str]]:
    cap = root / "captures"
    for p in sorted(cap.rglob("*")):
        rel = p.relative_to(cap)
        if rel.parts and rel.parts[0] in SKIP or not p.is_file():
            continue
        yield p, str(rel)
    logs = root / "logs"
    if logs.is_dir():
        for p in sorted(logs.rglob("*")):
            if p.is_file():
                yield p, str(Path("node-logs") / p.relative_to(logs))


def archive_chunks(node_dir: str, node_id: str) -> Iterator[bytes]:
    """A tar of one node directory's captures and logs, in pieces of at most :data:`CHUNK` bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, name in _members(Path(node_dir) / node_id):
            tar.add(str(path), arcname=name)
            if buf.tell() >= CHUNK:
                data = buf.getvalue()
                yield data
                buf.seek(0)
                buf.truncate()
    data = buf.getvalue()
    if data:
        yield data


def unpack(chunks: Iterator[bytes], target: Path) -> tuple[int, int]:
    """Write the streamed archive into ``target``; (files, bytes)."""
    target.mkdir(parents=True, exist_ok=True)
    raw = b"".join(chunks)
    files = size = 0
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r") as tar:
        for m in tar.getmembers():
            if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts:
                continue
            tar.extract(m, target, filter="data")
            files += 1
            size += m.size
    return files, size


def gather(node_dir: str, to: str | Path, resource: str = "", log: Any = print) -> dict[str, Any]:
    """Copy every node directory reachable through a live node into ``to/<node id>/`` (module docstring).
    Ray must be connected (``ray.init(address=...)``)."""
    import ray

    from .placement import live_nodes, pinned

    listing = ray.remote(num_cpus=0)(visible_node_dirs)
    archive = ray.remote(num_cpus=0, num_returns="streaming")(archive_chunks)
    nodes = [n["NodeID"] for n in live_nodes(resource)]
    seen = dict(zip(nodes, ray.get([listing.options(scheduling_strategy=pinned(n)).remote(node_dir) for n in nodes])))
    alive = set(n["NodeID"] for n in live_nodes())
    known = sorted({d for ds in seen.values() for d in ds} | set(nodes))
    to = Path(to)
    out: dict[str, Any] = {}
    for nid in known:
        via = nid if nid in seen and nid in seen[nid] else next((n for n in nodes if nid in seen[n]), None)
        if via is None:
            out[nid] = {"files": 0, "bytes": 0, "via": None, "lost": nid not in alive,
                        "state": "unreachable" if nid not in alive else "empty"}
            continue
        gen = archive.options(scheduling_strategy=pinned(via)).remote(node_dir, nid)
        files, size = unpack((ray.get(ref) for ref in gen), to / nid)
        out[nid] = {"files": files, "bytes": size, "via": via, "lost": nid not in alive, "state": "copied"}
        log(f"{nid[:12]}: {files} files, {size / 2**20:.1f} MiB" + (f" (lost node, read through {via[:12]})"
                                                                     if nid not in alive else ""))
    to.mkdir(parents=True, exist_ok=True)
    (to / "gather.json").write_text(json.dumps({"node_dir": node_dir, "nodes": out}, indent=2))
    return out
