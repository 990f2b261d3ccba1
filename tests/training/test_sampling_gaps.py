"""What the trainer must not get wrong about the sampling distribution (issue 25, item 7): calls
whose distribution it cannot reproduce are refused, naming the cause (structured output, a forced
tool_choice, logit_bias, min_tokens); NaN behaviour logprobs are refused; the policy's and the
reference's logprobs follow each token's temperature/top-k/top-p; top-p's boundary is vLLM's."""

from __future__ import annotations

import copy

import polars as pl
import pytest
import torch

from polar_analysis.trajectories.common import trainer_sampling
from polar_proxy import sampling
from polar_training.loss import LossConfig
from polar_training.packing import build_microbatches, sequences_from_frame
from polar_training.policy import chunked_token_logprobs, policy_logprobs, sampling_keep_mask
from polar_training.trainer import GRPOTrainer, TrainConfig

from .conftest import SMALL_VOCAB

#: vLLM 0.32 serving defaults read from the server: plain sampling, processed logprobs.
SERVER = {"defaults": {}, "defaults_from": "vllm", "logprobs_mode": "processed_logprobs"}
PLAIN = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}]


def _google_structured_chat() -> dict:
    """A Gemini CLI-style request with a response schema, translated by the proxy's Google provider."""
    from polar_proxy.providers.google import GoogleProvider

    body = {"contents": [{"role": "user", "parts": [{"text": "route this"}]}],
            "generationConfig": {"temperature": 1, "responseMimeType": "application/json",
                                 "responseJsonSchema": {"type": "OBJECT", "properties": {"model": {"type": "STRING"}}}}}
    return GoogleProvider().to_chat(body, "/v1beta/models/gemini-2.5-pro:generateContent", {}).chat_request


CASES = {
    "google-json-schema": (_google_structured_chat, "response_format=json_schema"),
    "json-object": (lambda: {**PLAIN, "response_format": {"type": "json_object"}}, "response_format=json_object"),
    "tool-choice-required": (lambda: {**PLAIN, "tools": TOOLS, "tool_choice": "required"}, "tool_choice=required"),
    "tool-choice-named": (lambda: {**PLAIN, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read"}}},
                          "tool_choice=named:read"),
    "logit-bias": (lambda: {**PLAIN, "logit_bias": {"42": 5.0, "7": -100}}, "logit_bias=2"),
    "min-tokens": (lambda: {**PLAIN, "min_tokens": 16}, "min_tokens=16"),
    "vllm-structured-outputs": (lambda: {**PLAIN, "structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs=True"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_decoding_is_recorded_and_refused_naming_the_call(case):
    make, expect = CASES[case]
    chat = make()
    rec = sampling.effective(chat, SERVER)
    assert rec["constraints"], rec
    t, _, _, issue = trainer_sampling(rec, "call c1 (session s, call #0)")
    assert t is None and issue.startswith("call c1 (session s, call #0): sampled with") and expect in issue, issue


@pytest.mark.parametrize("chat", [
    PLAIN,
    {**PLAIN, "tools": TOOLS, "tool_choice": "auto"},
    {**PLAIN, "tools": TOOLS, "tool_choice": "none"},
    {**PLAIN, "response_format": {"type": "text"}},
    {**PLAIN, "logit_bias": {}, "min_tokens": 0},
], ids=["plain", "tool-choice-auto", "tool-choice-none", "response-format-text", "empty-bias-zero-min-tokens"])
def test_unconstrained_calls_are_trained(chat):
    rec = sampling.effective(chat, SERVER)
    assert "constraints" not in rec  # the record of a plain call is unchanged
    assert trainer_sampling(rec, "call c1") == (1.0, 0, 1.0, None)


def _frame(make_frame, **cols) -> pl.DataFrame:
    return make_frame(groups=1, samples=2, vocab=SMALL_VOCAB).with_columns(advantage=pl.lit(0.5), **cols)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_non_finite_behaviour_logprobs_are_refused(make_frame, bad):
    frame = _frame(make_frame)
    lps = frame["logprobs"].to_list()
    mask = frame["loss_mask"][1].to_list()
    t = mask.index(1) + 1
    lps[1] = lps[1][:t] + [bad] + lps[1][t + 1 :]
    frame = frame.with_columns(logprobs=pl.Series(lps, dtype=pl.List(pl.Float64)))
    with pytest.raises(ValueError, match=rf"g0-s1/0: behaviour logprob {bad} at sampled position {t}"):
        sequences_from_frame(frame)


def _sampled_frame(make_frame) -> pl.DataFrame:
    return _frame(make_frame).with_columns(
        temperature=pl.Series([0.7, 1.3]), top_k=pl.Series([20, 0], dtype=pl.Int32), top_p=pl.Series([0.9, 0.8]))


def _by_hand(model, mb) -> torch.Tensor:
    """The sampled-token logprobs of ``mb`` under each token's temperature/top-k/top-p, from the
    decoder's hidden states and the output layer directly."""
    with torch.no_grad():
        hidden = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).last_hidden_state
        lp, _ = chunked_token_logprobs(hidden[0, mb.logit_positions], model.lm_head.weight, mb.target_ids,
                                       temps=mb.temperature, top_k=mb.top_k, top_p=mb.top_p)
    return lp


def test_policy_logprobs_follow_each_tokens_sampling(small_qwen, make_frame):
    (mb,), _ = build_microbatches(sequences_from_frame(_sampled_frame(make_frame)), token_budget=10_000)
    assert mb.temperature is not None and mb.top_k is not None and mb.top_p is not None
    with torch.no_grad():
        got, _ = policy_logprobs(small_qwen, mb)
        plain = copy.copy(mb)
        plain.temperature = plain.top_k = plain.top_p = None
        ignored, _ = policy_logprobs(small_qwen, plain)
    torch.testing.assert_close(got, _by_hand(small_qwen, mb), rtol=0, atol=1e-5)
    assert (got - ignored).abs().max() > 0.05  # the test can tell: the plain distribution is another one
    for name in ("temperature", "top_k", "top_p"):  # each one matters on its own
        one = copy.copy(mb)
        setattr(one, name, None)
        with torch.no_grad():
            assert (policy_logprobs(small_qwen, one)[0] - got).abs().max() > 1e-3, name


def test_reference_and_old_logprobs_follow_each_tokens_sampling(small_qwen, make_frame):
    """The KL reference (a copy of the policy here) and the pre-update logprobs (TIS) are taken at
    the same temperature/top-k/top-p as the policy's: at step 0 both equal the policy's logprobs."""
    cfg = TrainConfig(lr=1e-4, token_budget=10_000, ppo_epochs=2, loss=LossConfig(kl_coef=0.01))
    trainer = GRPOTrainer(small_qwen, cfg, ref_model=copy.deepcopy(small_qwen))
    prep = trainer.prepare(_sampled_frame(make_frame))
    (mb,) = prep.minibatches[0]
    trainer.fill_ref_logprobs([mb])
    trainer.fill_old_logprobs([mb])
    want = _by_hand(small_qwen, mb)
    torch.testing.assert_close(mb.ref_logp, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(mb.old_logp, want, rtol=0, atol=1e-5)
    metrics = trainer.train_step([mb])
    assert metrics["kl"] < 1e-6  # reference == policy before the update, under the same distribution


@pytest.mark.parametrize("top_p, kept", [(0.5, 2), (0.75, 3), (0.25, 1), (0.9, 4)])
def test_top_p_boundary_is_vllms(top_p, kept):
    """vLLM 0.32 (``apply_top_k_top_p_pytorch``, v1/sample/ops/topk_topp_sampler.py) drops the
    entries whose ascending cumulative probability is ``<= 1 - p`` (``top_p_mask = probs_sum <= 1 -
    p``), keeping the largest always. Four equal logits make the cumulative sums exactly 0.25, 0.5,
    0.75, 1: at p = 0.5 an entry sits on the boundary and is dropped (``<`` would keep 3)."""
    z = torch.zeros(1, 4)
    keep = sampling_keep_mask(z, None, torch.tensor([top_p]))
    assert int(keep.sum()) == kept
    target = keep[0].nonzero()[0]  # a token vLLM could sample: its logprob is -log(kept)
    lp, _ = chunked_token_logprobs(torch.eye(4)[:1], z.new_zeros(4, 4), target, top_p=torch.tensor([top_p]))
    assert lp.item() == pytest.approx(-torch.log(torch.tensor(float(kept))).item(), abs=1e-7)
