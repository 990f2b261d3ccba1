"""Exact history with images and weight versions: render's features reach generate (a splice that
would move the image placeholders takes the rendered ids instead), and generate's weight_versions
are checked against the call's policy_version on every call, whole and streamed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from polar_proxy.exact_history import MEDIA_RENDERED, WEIGHT_VERSION_MISMATCH, ExactHistory, FeedReader, Pending, _Ctx
from polar_proxy.ledger import Answer, context_digest, message_digests, new_entry

FEATURES = {"mm_hashes": {"image": ["h1"]}, "mm_placeholders": {"image": [{"offset": 3, "length": 2}]},
            "kwargs_data": {"image": ["b64"]}, "mm_metadata": None}


class _Exact(ExactHistory):
    """ExactHistory with the upstream answered here: render, generate and derender."""

    def __init__(self, rendered: list[int], features: Any, versions: Any = None):
        super().__init__(None)  # type: ignore[arg-type]
        self.rendered, self.features, self.versions = rendered, features, versions
        self.sent: dict[str, Any] = {}
        self.think_ids["http://up"] = None

    async def _call(self, url: str, body: Any, timeout: Any, headers: Any) -> Any:
        path = url.removeprefix("http://up")
        self.sent[path] = body
        if path.endswith("/render"):
            return {"request_id": "r", "token_ids": self.rendered, "token_offsets": None, "features": self.features,
                    "sampling_params": {"temperature": 1.0}}
        if path.endswith("/generate"):
            return {"choices": [{"index": 0, "token_ids": [50, 2], "finish_reason": "stop", "stop_reason": None,
                                 "logprobs": None, "weight_versions": self.versions}]}
        return {"choices": [{"message": {"role": "assistant", "content": "a cat"}}]}


def _rec(call_id: str = "c2", policy_version: int | None = 3) -> Any:
    return SimpleNamespace(call_id=call_id, session_id="s", translation_notes=[], sampling=None, history=None,
                           history_cause=None, rendered_prompt_diff=None, policy_version=policy_version)


def _post(ex: _Exact, messages: list[dict], rec: Any) -> None:
    chat = {"model": "m", "messages": messages}
    asyncio.run(ex._post("http://up", chat, rec, stream=False, timeout=None, max_model_len=None, headers={}))


IMAGE_TURN = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                                          {"type": "text", "text": "and this one?"}]}


def test_render_features_reach_generate() -> None:
    ex = _Exact([1, 2, 3, 9, 9, 4], FEATURES)
    _post(ex, [IMAGE_TURN], _rec())
    assert ex.sent["/inference/v1/generate"]["features"] == FEATURES
    assert ex.sent["/inference/v1/generate"]["token_ids"] == [1, 2, 3, 9, 9, 4]


def test_a_splice_that_would_move_the_image_placeholders_takes_the_rendered_ids() -> None:
    first = [{"role": "user", "content": "hi"}]
    answer = {"role": "assistant", "content": "hello"}
    rendered = [1, 5, 6, 2, 1, 3, 9, 9, 4]  # the answer re-rendered as [5, 6]; it was sampled as [7, 8, 2]
    ex = _Exact(rendered, FEATURES)
    ex.ledger.session("s")
    ex.ledger.add("s", new_entry(0, context_digest({"model": "m"}), message_digests(first), [1], [1], [7, 8, 2], "stop",
                                 Answer.from_message(answer), exact=True))
    rec = _rec()
    _post(ex, [*first, answer, IMAGE_TURN], rec)
    gen = ex.sent["/inference/v1/generate"]
    assert gen["token_ids"] == rendered and gen["features"] == FEATURES  # never placeholders without the image
    assert rec.history == "rendered" and rec.history_cause == MEDIA_RENDERED and ex.stats["media_rendered"] == 1
    # without an image the same history is spliced
    ex2 = _Exact(rendered, None)
    ex2.ledger.session("s")
    ex2.ledger.add("s", new_entry(0, context_digest({"model": "m"}), message_digests(first), [1], [1], [7, 8, 2], "stop",
                                  Answer.from_message(answer), exact=True))
    rec2 = _rec()
    _post(ex2, [*first, answer, {"role": "user", "content": "more"}], rec2)
    assert rec2.history == "exact" and ex2.sent["/inference/v1/generate"]["token_ids"][:4] == [1, 7, 8, 2]
    assert "features" not in ex2.sent["/inference/v1/generate"]


def test_weight_versions_are_checked_against_the_policy_version_whole() -> None:
    ok = _Exact([1, 2], None, versions=[{"version": "3", "start": 0, "end": 2}])
    rec = _rec()
    _post(ok, [{"role": "user", "content": "hi"}], rec)
    assert not any(WEIGHT_VERSION_MISMATCH in n for n in rec.translation_notes) and ok.stats["weight_version_mismatch"] == 0
    bad = _Exact([1, 2], None, versions=[{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}])
    rec = _rec()
    _post(bad, [{"role": "user", "content": "hi"}], rec)
    assert [n for n in rec.translation_notes if n.startswith(WEIGHT_VERSION_MISMATCH)] == [
        "weight_version_mismatch: sampled by weights 3, 4, policy_version 3"]
    assert bad.stats["weight_version_mismatch"] == 1


class _Resp:
    def __init__(self, events: list[bytes]):
        async def it():
            for e in events:
                yield e
        self.content = SimpleNamespace(iter_any=it)

    def close(self) -> None:
        pass


def test_weight_versions_are_checked_on_a_stream() -> None:
    ex = _Exact([1, 2], None)
    rec = _rec(policy_version=5)
    ex.pending[rec.call_id] = Pending(b"", [], [1, 2])
    ctx = _Ctx(ex, "http://up", {"model": "m", "messages": []}, rec, [1, 2], None, {})
    events = [b'data: {"choices":[{"index":0,"text":"a","token_ids":[50],"weight_versions":[{"version":"5","start":0,"end":1}]}]}\n\n',
              b'data: {"choices":[{"index":0,"text":" cat","token_ids":[2],"finish_reason":"stop",'
              b'"weight_versions":[{"version":"6","start":1,"end":2}]}]}\n\n', b"data: [DONE]\n\n"]
    out = FeedReader()
    asyncio.run(ctx.stream(_Resp(events), out))  # type: ignore[arg-type]
    assert any(n.startswith("weight_version_mismatch: sampled by weights 5, 6, policy_version 5") for n in rec.translation_notes)
    assert ex.stats["weight_version_mismatch"] == 1
