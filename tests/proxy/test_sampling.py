"""``polar_sampling``: the rollout's sampling parameters reach vLLM whatever the harness sends.

The trainer computes logprobs from plain logits; a token is on-policy only if vLLM sampled it from
that distribution, so the proxy must overwrite a harness's temperature/top-p (and the server's
generation-config defaults, which apply when a field is absent) and record what it sent.
"""

from __future__ import annotations

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from polar_proxy import sampling
from polar_proxy.addon import Polar


def test_parse_reads_every_field_with_its_type_and_names_bad_parts() -> None:
    got = sampling.parse("temperature=0.7, top_p=0.9,top_k=-1,min_p=0,repetition_penalty=1,seed=7")
    assert got == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 7}
    assert isinstance(got["top_k"], int) and isinstance(got["min_p"], float)
    assert sampling.parse(None) == sampling.parse("") == {}
    for bad, says in (("temp=1", "temp=1"), ("top_k=0.5", "top_k must be int"), ("temperature", "temperature"),
                      ("temperature=-1", ">= 0")):
        with pytest.raises(ValueError, match=says):
            sampling.parse(bad)


def test_call_seeds_are_reproducible_and_differ_across_calls_and_sessions() -> None:
    a = sampling.call_seed(7, "s1", 0)
    assert a == sampling.call_seed(7, "s1", 0) and 0 <= a < 2**31
    others = {sampling.call_seed(7, "s1", 1), sampling.call_seed(7, "s2", 0), sampling.call_seed(8, "s1", 0)}
    assert a not in others and len(others) == 3


def test_apply_overwrites_what_the_harness_asked_for() -> None:
    chat = {"temperature": 0.2, "top_p": 0.5, "messages": []}
    sampling.apply(chat, sampling.parse("temperature=1,top_p=1,top_k=-1,seed=3"), "sess", 4)
    assert chat == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": sampling.call_seed(3, "sess", 4),
                    "messages": []}
    untouched = {"temperature": 0.2}
    sampling.apply(untouched, {}, "sess", 0)
    assert untouched == {"temperature": 0.2}


def test_option_is_validated_in_configure(tmp_path) -> None:
    addon = Polar()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_capture_dir=str(tmp_path), polar_sampling="temperature=1,seed=5")
        assert addon.state.sampling == {"temperature": 1.0, "seed": 5}
        with pytest.raises(exceptions.OptionsError, match="polar_sampling"):
            tctx.configure(addon, polar_sampling="warmth=3")
        assert addon.state.sampling == {"temperature": 1.0, "seed": 5}  # a refused value keeps the old one


@pytest.mark.slow
def test_enforced_sampling_reaches_the_upstream_and_the_capture(helpers, upstream, proxy_factory, session_id) -> None:
    proxy = proxy_factory(upstream.url, options={"polar_sampling": "temperature=1,top_p=1,top_k=-1,seed=11"})
    seeds = []
    for turn in range(2):
        body = {"model": "m", "temperature": 0.3, "top_p": 0.5,
                "messages": [{"role": "user", "content": f"turn {turn} #scenario:text"}]}
        ans = helpers.request(proxy.url + "/v1/chat/completions", body, headers={"x-polar-session": session_id})
        assert ans.status == 200, ans.body[:300]
        sent = upstream.upstream.requests[-1]
        assert (sent["temperature"], sent["top_p"], sent["top_k"]) == (1.0, 1.0, -1)
        seeds.append(sent["seed"])
    recs = helpers.read_records(proxy.capture_dir, session_id)
    assert [r["normalized_request"]["seed"] for r in recs] == seeds
    assert seeds == [sampling.call_seed(11, session_id, r["call_index"]) for r in recs] and seeds[0] != seeds[1]
    assert all(r["native_request"]["temperature"] == 0.3 for r in recs)  # the harness's own request is kept as sent
