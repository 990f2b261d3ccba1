"""``polar slurm CONFIG``: the sbatch script that starts Ray on a Slurm allocation and runs the loop on it.

The template (``slurm.sbatch.tmpl``, next to this file) follows NeMo RL's ``ray.sub``: one srun step
per node, the Ray head on the first node, workers given its address, a wait until every node has
joined, then ``polar loop CONFIG`` with ``RAY_ADDRESS`` set (the config says ``[placement] kind =
"ray"`` and ``address = "auto"``). docs/slurm.md walks through it.

Placeholders are ``{{name}}``: bash's own ``${...}`` and ``$(...)`` stay untouched, and a
placeholder this module does not fill is an error, never a script with a hole in it (``--template``:
a site's own copy, e.g. with its ``module load`` lines). Every value is checked here (integers, a Slurm time, a
job name Slurm accepts) and paths are shell-quoted: the script is run as the user on every node.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TEMPLATE = Path(__file__).with_name("slurm.sbatch.tmpl")
PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}")
#: Slurm's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class TemplateError(ValueError):
    pass


@dataclass
class SlurmJob:
    """What the script needs: the allocation's shape and where the loop's config and venv are."""

    config: Path  # the loop's TOML (on a filesystem every node sees)
    nodes: int
    cpus_per_node: int
    gpus_per_node: int = 0
    time: str = "04:00:00"
    job_name: str = "polar-loop"
    venv: Optional[Path] = None  # default: the environment running this (sys.prefix)
    log_dir: Optional[Path] = None  # default: the config's directory
    partition: Optional[str] = None
    account: Optional[str] = None
    ray_port: int = 6379
    wait_s: int = 600  # how long the nodes may take to join


def _positive(name: str, value: int, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TemplateError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def values(job: SlurmJob) -> dict[str, str]:
    """The placeholders' values, checked and quoted for where they go."""
    if not _TIME.match(job.time):
        raise TemplateError(f"time {job.time!r} is not a Slurm time (minutes, HH:MM:SS or D-HH:MM:SS)")
    if not _NAME.match(job.job_name):
        raise TemplateError(f"job name {job.job_name!r}: letters, digits, '_', '.', '-' only")
    config = Path(job.config).absolute()
    log_dir = Path(job.log_dir or config.parent).absolute()
    extra = []
    if job.gpus_per_node:
        extra.append(f"#SBATCH --gpus-per-node={_positive('gpus_per_node', job.gpus_per_node)}")
    for flag, value in (("partition", job.partition), ("account", job.account)):
        if value:
            if not _NAME.match(value):
                raise TemplateError(f"{flag} {value!r}: letters, digits, '_', '.', '-' only")
            extra.append(f"#SBATCH --{flag}={value}")
    if any(c.isspace() for c in str(log_dir)):
        raise TemplateError(f"log_dir {log_dir} has whitespace, which #SBATCH --output cannot hold")
    return {
        "job_name": job.job_name,
        "nodes": str(_positive("nodes", job.nodes)),
        "cpus_per_node": str(_positive("cpus_per_node", job.cpus_per_node)),
        "gpus_per_node": str(_positive("gpus_per_node", job.gpus_per_node, least=0)),
        "time": job.time,
        "log_dir": str(log_dir),
        "extra_directives": "\n".join(extra),
        "venv": shlex.quote(str(Path(job.venv or sys.prefix).absolute())),
        "config": shlex.quote(str(config)),
        "ray_port": str(_positive("ray_port", job.ray_port)),
        "wait_s": str(_positive("wait_s", job.wait_s)),
    }


def fill(template: str, given: dict[str, str]) -> str:
    """Substitute every ``{{name}}``; a placeholder without a value is an error (a template of one's
    own may leave values unused)."""
    used = set(PLACEHOLDER.findall(template))
    unknown = sorted(used - given.keys())
    if unknown:
        raise TemplateError(f"the template has placeholder(s) nobody fills: {', '.join(unknown)}")
    return PLACEHOLDER.sub(lambda m: given[m.group(1)], template)


def render(job: SlurmJob, template: Optional[str] = None) -> str:
    """The sbatch script for ``job`` (``template``: another template's text; default the shipped one)."""
    return fill(TEMPLATE.read_text() if template is None else template, values(job))
