"""The two checks that need the trainer or the server: logprob agreement and policy delivery.

**Logprob agreement.** The trainer recomputes every captured sequence's logprobs at the weights that
served them (``polar_training.behaviour_gap``: the same pass the first GRPO update makes); their
mean gap to vLLM's is the trainer's ``mismatch_kl``. In float32 on CPU a token trained in the context
and at the temperature it was sampled in agrees to ~1e-5 (tests/training/test_behaviour_logprobs.py),
so ``|mismatch_kl| <= 1e-3`` passes and the largest per-token gap is reported with it. A server in
bf16 (a GPU) rounds every activation: its gap is measured, not graded yet (no GPU measurement to set
the bound from).

**Policy delivery.** After one training step the new weights are pushed (``push_weights``: the
proxy's gate held, reloaded, verified), then certify asks the server itself: the checkpoint's probe
(the canary prompt, with the trainer's logprobs under the new and the previous weights) is served
again and :func:`polar_training.push_probe.probe_verdict` says whose logprobs they are (``alpha``:
the served change as a fraction of the predicted one, 1 new, 0 previous). Then every call after the
push must carry the pushed version. A push that failed, a server that still serves the old weights
(a stale push), or a later call under another version FAILs.
"""

from __future__ import annotations

import math
from typing import Any

from .checks import MEASURED, CheckResult, judge

#: |mismatch_kl| accepted, float32 trainer vs float32 vLLM on CPU (the issue's bound; measured ~1e-5)
MISMATCH_KL_MAX = 1e-3


def check_logprob_agreement(gap: dict[str, float] | None, served_dtype: str | None = "float32",
                            error: str | None = None) -> CheckResult:
    """Grade :func:`polar_training.behaviour_gap.behaviour_gap`'s figures (None: not measured)."""
    if error:
        return judge("logprob agreement", 0, [f"the trainer could not recompute the logprobs: {error}"],
                     "not measured")
    if not gap or not gap.get("tokens"):
        return judge("logprob agreement", 0, [], "no sampled tokens to recompute")
    kl, worst, n = float(gap["mismatch_kl"]), float(gap["max_abs_gap"]), int(gap["tokens"])
    measured = f"mismatch_kl {kl:.2e} over {n} tokens, max per-token |diff| {worst:.2e}"
    if gap.get("later_tokens"):
        measured += f" (later turns: {gap['later_mismatch_kl']:.2e}, max {gap['later_max_abs_gap']:.2e})"
    notes = [f"{int(gap['refused_rows'])} sequence(s) the trainer refuses left out (see sampling)"] if gap.get("refused_rows") else []
    dtype = str(served_dtype or "float32").removeprefix("torch.")
    if dtype != "float32":
        res = judge("logprob agreement", n, [], measured, value=kl, notes=notes)
        if res.state != "NOT EXERCISED":
            res.state = MEASURED
            res.details.append(f"served in {dtype}: measured, not graded yet (the bound is for float32 on CPU)")
        return res
    failures = []
    if math.isnan(kl) or abs(kl) > MISMATCH_KL_MAX:
        failures.append(f"|mismatch_kl| {abs(kl):.2e} > {MISMATCH_KL_MAX:g} (float32): the trainer does not compute "
                        f"the distribution vLLM sampled from (max per-token |diff| {worst:.2e})")
    return judge("logprob agreement", n, failures, measured, value=kl, notes=notes)


def served_verdict(base_url: str, checkpoint_dir: str) -> dict[str, Any]:
    """Whose weights the server serves now, by the checkpoint's probe (the canary prompt): the
    verdict of :func:`probe_verdict` (``state`` new | previous | unknown, ``alpha``, ``separation``)
    and the largest |served - trained| probe logprob. Raises when the checkpoint carries no probe."""
    from polar_training.checkpoint import read_meta
    from polar_training.push_probe import _least_precise, probe_verdict, served_dtype, served_probe_logprobs

    meta = read_meta(checkpoint_dir)
    probe = meta.get("probe") or {}
    if not probe.get("ids") or not probe.get("logprobs_before"):
        raise ValueError(f"{checkpoint_dir} carries no probe with the previous weights' logprobs")
    served = served_probe_logprobs(base_url, probe["ids"])
    dtype = _least_precise(meta.get("compute_dtype") or meta.get("dtype", "float32"), served_dtype(base_url))
    v = probe_verdict(served, probe["logprobs"], probe["logprobs_before"], dtype)
    return {"state": v.state, "alpha": v.alpha, "separation": v.separation, "noise": v.noise, "reason": v.reason,
            "probe_tokens": len(probe["ids"]) - 1, "dtype": dtype,
            "max_abs_diff_new": max((abs(a - b) for a, b in zip(served, probe["logprobs"])), default=0.0)}


def check_policy_delivery(version: int | None, push_error: str | None, verdict: dict[str, Any] | None,
                          later_versions: list[int | None], train_note: str | None = None) -> CheckResult:
    """Grade one push: it succeeded, the server's canary logprobs are the new weights' (``verdict``
    from :func:`served_verdict`), and every call after it (``later_versions``) carries ``version``."""
    failures: list[str] = []
    if version is None:  # no update was made: nothing was pushed, nothing to judge
        return judge("policy delivery", 0, [], f"no training step to push ({train_note or 'no update'})")
    if push_error:
        failures.append(f"push of v{version} failed: {push_error[:400]}")
    if verdict is None:
        failures.append("the served canary logprobs could not be measured")
    elif verdict["state"] != "new":
        failures.append(f"served canary logprobs are {verdict['state']}, not the pushed weights': served change "
                        f"{verdict['alpha']:.3f} x the predicted one (separation {verdict['separation']:.1f} noise units)"
                        + (f"; {verdict['reason']}" if verdict.get("reason") else ""))
    wrong = [v for v in later_versions if v != version]
    if wrong:
        failures.append(f"{len(wrong)}/{len(later_versions)} calls after the push carry policy version(s) "
                        f"{sorted({str(v) for v in wrong})}, not v{version}")
    alpha = f"served change {verdict['alpha']:.3f} x predicted, separation {verdict['separation']:.0f}" if verdict else "no canary"
    measured = f"v{version}: {alpha}; {len(later_versions) - len(wrong)}/{len(later_versions)} later calls carry v{version}"
    return judge("policy delivery", len(later_versions), failures, measured,
                 value=verdict["alpha"] if verdict else None)
