"""The trainer refuses trajectories whose token ids belong to another tokenizer than its model's.

Trajectories record the served model and a tokenizer fingerprint (``polar_core.tokenizer_identity``;
written by ``polar trajectories`` and the demo). Without this check, ``polar train --model`` pointed
at another family (the demo's Qwen2.5 ids on SmolLM2) died in ``torch.embedding`` with ``IndexError:
index out of range in self``, and with a larger vocabulary would have trained on the wrong tokens
silently. Sizes of one family share a fingerprint (the embedding's padding rows are not part of
it), so the 0.5B's captures may train the 7B. Trajectories written before the fingerprint existed
(or built without a tokenizer) are trained with a warning: nothing to check them against.
"""

from __future__ import annotations

from typing import Any

from polar_core.tokenizer_identity import fingerprint_of_dir


class TokenizerMismatch(ValueError):
    """The trajectories' token ids are another tokenizer's than the model's."""


def check_trajectories(frame: Any, model_dir: str, model_fingerprint: str | None = None) -> str | None:
    """Raise :class:`TokenizerMismatch` naming both sides when the frame's tokenizer fingerprint is
    not the model's; return a warning (str) when it cannot be checked; None when it matches.
    ``model_fingerprint``: already computed (the persistent trainer checks every step)."""
    cols = frame.columns if hasattr(frame, "columns") else []
    served = sorted({m for m in (frame["served_model"].drop_nulls().unique().to_list() if "served_model" in cols else [])
                     if m})
    served_s = ", ".join(served) or "an unnamed model"
    fps = frame["tokenizer_fingerprint"].drop_nulls().unique().to_list() if "tokenizer_fingerprint" in cols else []
    if not fps:
        return (f"the trajectories (sampled from {served_s}) carry no tokenizer fingerprint (written before it "
                f"existed, or built without the model's tokenizer): cannot check that their token ids are "
                f"{model_dir}'s; rebuild them with `polar trajectories --model DIR` to have it checked")
    mine = model_fingerprint or fingerprint_of_dir(model_dir)
    if mine is None:
        return f"{model_dir} has no tokenizer files: cannot check the trajectories' token ids ({served_s}) against it"
    other = sorted(fp for fp in fps if fp != mine)
    if other:
        raise TokenizerMismatch(
            f"the trajectories were sampled from {served_s} (tokenizer {', '.join(other)}), but the model "
            f"{model_dir} has another tokenizer ({mine}): their token ids would mean other tokens. Train the "
            f"model that served them (or one of its sizes), or rebuild the trajectories from captures of this one.")
    return None
