"""Exact history asks the server whether its template drops a re-sent answer's reasoning, end to
end through the proxy (scripted upstream, its render endpoint templating like a DeepSeek-R1
distill: an earlier assistant turn is rendered as its content alone)."""

from __future__ import annotations

from typing import Any

import pytest

from polar_testing.scripted_upstream import ServerThread, Tokenizer


class DropsReasoning(Tokenizer):
    """The cheap template, but an assistant message's reasoning never reaches the rendering."""

    def message_ids(self, m: dict[str, Any]) -> list[int]:
        if m.get("role") == "assistant":
            m = {k: v for k, v in m.items() if k not in ("reasoning", "reasoning_content")}
        return super().message_ids(m)


@pytest.fixture(scope="module")
def dropping():
    with ServerThread(max_model_len=8192) as server:
        server.upstream.tok.__class__ = DropsReasoning
        yield server


def _ask(helpers: Any, proxy: Any, session: str, messages: list[dict[str, Any]]) -> Any:
    r = helpers.request(proxy.url + "/v1/chat/completions", {"model": "gpt-x", "messages": messages},
                        headers={"x-session-id": session})
    assert r.status == 200, r.body[:500]
    return r.json()["choices"][0]["message"]


def test_a_template_that_drops_the_reasoning_gets_its_rendering(helpers, dropping, proxy_factory, session_id) -> None:
    proxy = proxy_factory(dropping.url, options={"polar_exact_history": True})
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "pick a number #scenario:reasoning"}]
    first = _ask(helpers, proxy, session_id, messages)
    assert first["content"] == "The answer is 42."
    messages += [{"role": "assistant", "content": first["content"]},  # re-sent as the harness got it
                 {"role": "user", "content": "again #scenario:text"}]
    _ask(helpers, proxy, session_id, messages)
    r1, r2 = helpers.read_records(proxy.capture_dir, session_id)
    assert r1["output_reasoning"] and dropping.upstream.tok.pieces("<think>", "markup")[0].token_id in r1["sampled_token_ids"]
    # the proxy asked (two renders, with and without the reasoning): the template drops it, so the
    # model is prompted with the rendering, not with its sampled reasoning ids
    assert r2["history_cause"] == "template_dropped_reasoning", (r2["history"], r2["history_cause"])
    assert r2["history"].startswith("spliced_at=")
    check = [c for c in dropping.upstream.prompt_checks if c["session"] == session_id][-1]
    assert r2["prompt_token_ids"] == check["rendered"] == check["received"]
    lead = r1["prompt_token_ids"] + r1["sampled_token_ids"]
    assert r2["prompt_token_ids"][: len(lead)] != lead  # the sampled reasoning is not in the prompt
