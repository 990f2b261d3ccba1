"""pass@k with standard errors: the statistics of ``polar eval`` (pure Python, no runtime).

**The estimator.** With ``n`` graded samples of a task of which ``c`` passed, the chance that at
least one of ``k`` samples drawn without replacement passes is ``1 - C(n-c, k) / C(n, k)``: the
unbiased estimator of pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code"), better than ``1 - (1 - c/n)^k``, which is biased low. It is computed as the product
``prod_{i=n-c+1}^{n} (1 - k/i)`` (no large binomials). ``k`` must not exceed ``n``.

**Standard error of a task.** pass@k of one task is a U-statistic of its ``n`` samples; its
standard error is estimated by the jackknife: leave each sample out, recompute, and take
``sqrt((n-1)/n * sum (theta_i - mean)^2)``. The leave-one-out values take only two forms (a passed
sample left out: ``(n-1, c-1)``; a failed one: ``(n-1, c)``), so it costs two estimator calls. For
pass@1 it is exactly ``sqrt(p(1-p)/(n-1))`` with ``p = c/n``, the usual standard error of a mean
with the unbiased variance. It needs ``k <= n - 1`` (else None), and it is 0 when every sample
agrees (``c = 0`` or ``c = n``): with few samples that says little, so read it with ``n``.

**Over tasks.** The overall pass@k is the mean over tasks (each task weighs the same, whatever its
number of graded samples) of the tasks where it is defined (``k <= n``). Two standard errors,
because they answer different questions:

* ``stderr``: ``sqrt(sum se_t^2) / T``: how much a rerun on *these* tasks would move the figure
  (sampling noise only; the task set is fixed). This is the one the tables print.
* ``stderr_tasks``: the standard deviation of the per-task values over ``sqrt(T)`` (T >= 2): how
  much the figure would move on another draw of tasks from the same population, the clustered
  error of Miller 2024 ("Adding Error Bars to Evals"), which includes the sampling noise. With the
  six built-in tasks it is large, and that is the honest reading.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of ``c`` passes among ``n`` samples (``1 <= k <= n``, ``0 <= c <= n``)."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a pass
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_stderr(n: int, c: int, k: int) -> float | None:
    """Jackknife standard error of :func:`pass_at_k`; None when ``k > n - 1`` (nothing to leave out)."""
    if k > n - 1:
        return None
    out_pass = pass_at_k(n - 1, c - 1, k) if c > 0 else 0.0  # a passed sample left out (c of them)
    out_fail = pass_at_k(n - 1, c, k) if c < n else 0.0  # a failed sample left out (n - c of them)
    mean = (c * out_pass + (n - c) * out_fail) / n
    ss = c * (out_pass - mean) ** 2 + (n - c) * (out_fail - mean) ** 2
    return math.sqrt((n - 1) / n * ss)


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself: the k a table shows for ``n`` samples per task."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if n >= 1 and ks[-1] != n:
        ks.append(n)
    return ks


@dataclass
class TaskScore:
    """One task: its samples, how many were graded and passed, pass@k and its standard error per k."""

    task_id: str
    samples: int  # every sample of the task, infrastructure failures included
    graded: int  # the n of the estimator
    passed: int  # the c of the estimator
    infra_failures: int  # samples without a model verdict (see polar_runtime.evaluation)
    pass_at: dict[int, float | None] = field(default_factory=dict)  # None: k > graded
    stderr: dict[int, float | None] = field(default_factory=dict)  # None: k > graded - 1


def score_task(task_id: str, outcomes: Sequence[bool | None], ks: Iterable[int], *, infra_as_fail: bool = False) -> TaskScore:
    """``outcomes``: True (passed), False (failed), None (infrastructure failure: left out of ``n``,
    or counted as a failure with ``infra_as_fail``)."""
    infra = sum(1 for o in outcomes if o is None)
    graded = [bool(o) for o in outcomes if o is not None or infra_as_fail]
    n, c = len(graded), sum(graded)
    score = TaskScore(task_id, len(outcomes), n, c, infra)
    for k in ks:
        score.pass_at[k] = pass_at_k(n, c, k) if k <= n else None
        score.stderr[k] = pass_at_k_stderr(n, c, k) if k <= n else None
    return score


@dataclass
class Overall:
    """The mean over tasks of pass@k, with both standard errors (see the module docstring)."""

    k: int
    value: float | None
    stderr: float | None
    stderr_tasks: float | None
    tasks: int  # tasks where pass@k is defined (k <= their graded samples)


def overall(scores: Sequence[TaskScore], k: int) -> Overall:
    vals = [(s.pass_at[k], s.stderr.get(k)) for s in scores if s.pass_at.get(k) is not None]
    if not vals:
        return Overall(k, None, None, None, 0)
    t = len(vals)
    mean = sum(v for v, _ in vals) / t
    se = math.sqrt(sum(e * e for _, e in vals)) / t if all(e is not None for _, e in vals) else None
    se_tasks = math.sqrt(sum((v - mean) ** 2 for v, _ in vals) / (t - 1) / t) if t > 1 else None
    return Overall(k, mean, se, se_tasks, t)


def summarize(outcomes: dict[str, Sequence[bool | None]], ks: Iterable[int], *, infra_as_fail: bool = False) -> dict:
    """Per-task scores and the overall figures, as plain JSON-able data (k keys are strings)."""
    ks = sorted(set(ks))
    if not ks or ks[0] < 1:
        raise ValueError(f"k must be >= 1, not {ks}")
    scores = [score_task(t, o, ks, infra_as_fail=infra_as_fail) for t, o in sorted(outcomes.items())]
    tasks = []
    for s in scores:
        d = asdict(s)
        d["pass_at"] = {str(k): v for k, v in s.pass_at.items()}
        d["stderr"] = {str(k): v for k, v in s.stderr.items()}
        tasks.append(d)
    return {"ks": ks, "tasks": tasks, "overall": {str(k): asdict(overall(scores, k)) for k in ks}}
