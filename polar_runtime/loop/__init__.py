"""The RL loop as a product: ``polar loop CONFIG.toml``.

- ``config``: the one TOML file (model, harness, tasks, groups, iterations, sampling, trainer,
  evaluation, sandbox, placement, staleness), validated with the key and line of every error;
- ``state``: the loop's progress, written atomically once per finished step (what resume reads);
- ``placement``: where serving, rollouts and training run, behind one small interface
  (:class:`~polar_runtime.loop.placement.Placement`); ``local`` (this machine) is the default;
- ``loop``: the schedule (rollout -> trajectories -> GRPO step -> push), resumable after ``kill -9``;
- ``commands``: the ``polar loop`` command.
"""
