"""The trial environment: everything between a task on disk and its verdict, without the model.

What it owns (one folder each):

* ``tasks/``: the task formats (Harbor directories and datasets, the JSONL shorthand, the built-in
  datasets ``coding`` and ``followups``), the environment a task asks for (its Dockerfile, compose
  services, steps), how that environment is built (``environment.py`` on the host, ``imagebuild.py``
  into an image) and the static check of its scripts;
* ``sandbox/``: the sandbox backends every phase runs in (bubblewrap, docker, podman, apptainer, and
  ``host``, no isolation), the private Docker daemon, the egress proxy, the stand-in images, the
  safe file operations on trees a sample controls (``hostfs``), and the live trial of a container
  backend (``sandbox/trial.py``: one environment, agent and verifier phases exec'd in it);
* the trial around them: ``phases.py`` (an agent phase's sandbox spec, the live trial opened for a
  sample, the sample's dir sealed after it), ``steprun.py`` (a multi-step task's steps),
  ``verifier.py`` (the verifier phase and its :class:`Evaluation`), ``failures.py`` (why a verdict
  failed, from the CTRF report);
* ``commands.py``: ``polar docker`` (wired by ``polar_runtime/cli.py``, as the other areas' commands).

It imports only ``polar_core`` (``tests/test_layering.py``). It knows nothing of harnesses, the
proxy or the model: the runtime (``polar_runtime/rollout.py``) runs the harness in the spec it gets
from here and hands the result to :func:`verify`.

The interface is the names below, and the runtime imports nothing else of this package (the layering
test checks it; its named exceptions say why). Loading tasks: :func:`load_tasks`,
:func:`resolve_tasks_path`, :class:`Task`. Building their environment: :func:`prepare_workdir`,
:func:`task_image`, :func:`build_env`, :class:`BuildError`. Sandboxes: :func:`get_sandbox`,
:class:`SandboxSpec`. The trial: :func:`phase_spec`, :func:`open_live_trial`,
:func:`separate_verifier`, the steps' :func:`begin_step` / :func:`run_step_setup` /
:func:`verify_step` / :func:`finish_steps`, :func:`seal_sample_dir`. The verdict: :func:`verify`,
:class:`Evaluation`, :func:`from_notes`.
"""

from __future__ import annotations

from polar_trial.failures import FAILED, failure_notes, from_notes
from polar_trial.phases import open_live_trial, phase_spec, seal_sample_dir
from polar_trial.sandbox import (Sandbox, SandboxError, SandboxResult, SandboxSpec, SandboxUnavailable, available,
                                 get_sandbox, hostfs)
from polar_trial.sandbox.base import terminate_all as terminate_sandboxed
from polar_trial.sandbox.docker import DockerSandbox
from polar_trial.sandbox.dockerd import DaemonError, ensure_installed
from polar_trial.sandbox.hostpython import needed_libraries
from polar_trial.sandbox.trial import separate_verifier
from polar_trial.steprun import begin_step, verify_step
from polar_trial.steprun import finish as finish_steps
from polar_trial.steprun import run_setup as run_step_setup
from polar_trial.tasks import (TASKS_DIR, Environment, Step, Task, builtin_sets, is_task_dir, load_task_dir, load_tasks,
                               resolve_tasks_path, task_from_dict, write_harbor_dir)
from polar_trial.tasks.environment import BuildError, build_env, prepare_workdir
from polar_trial.tasks.harbor import load_dataset_report
from polar_trial.tasks.imagebuild import task_image
from polar_trial.tasks.model import CONTAINER_BACKENDS
from polar_trial.tasks.staticcheck import static_check
from polar_trial.verifier import Evaluation, verify

__all__ = [
    # tasks
    "TASKS_DIR", "CONTAINER_BACKENDS", "Environment", "Step", "Task", "builtin_sets", "is_task_dir", "load_task_dir",
    "load_tasks", "load_dataset_report", "resolve_tasks_path", "static_check", "task_from_dict", "write_harbor_dir",
    # their environment
    "BuildError", "build_env", "prepare_workdir", "task_image",
    # sandboxes (DockerSandbox, DaemonError, ensure_installed, needed_libraries: for polar_runtime/harnessruntime.py,
    # which brings a harness's own runtime into a task's image)
    "Sandbox", "SandboxError", "SandboxResult", "SandboxSpec", "SandboxUnavailable", "available", "get_sandbox",
    "terminate_sandboxed", "hostfs", "DockerSandbox", "DaemonError", "ensure_installed", "needed_libraries",
    # the trial
    "phase_spec", "open_live_trial", "separate_verifier", "seal_sample_dir", "begin_step", "run_step_setup",
    "verify_step", "finish_steps",
    # the verdict
    "Evaluation", "verify", "FAILED", "failure_notes", "from_notes",
]
