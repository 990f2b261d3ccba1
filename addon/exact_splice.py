"""How exact history's splice follows the chat template (``ledger.splice`` makes the splice: an
earlier call's prompt and sampled ids, then the rendering of what came after).

Two places where the sampled ids must give way to what the template renders: a template that
drops a re-sent answer's reasoning (the DeepSeek-R1 distills drop every earlier turn's; Qwen3 those
before the last user message), where prompting with the sampled reasoning would serve and train
the model on a context its template never produces; and Qwen3's empty think block with
``enable_thinking=false``, which only the generation prompt has, so the prefix check must compare
what precedes it. Whether the template drops the reasoning is asked of the server
(``exact_template.TemplateQuestions._drops_reasoning``).
"""

from __future__ import annotations

from typing import Any

from .ledger import TEMPLATE_NOT_PREFIX, Splice

#: the cause of a record prompted with the rendered ids because an image's placeholders index them
MEDIA_RENDERED = "media_rendered"
#: the cause a record names when the template renders an answer without the reasoning it sampled
TEMPLATE_DROPPED_REASONING = "template_dropped_reasoning"


def follow_template(sp: Splice, entry: Any, rendered: list[int], think: tuple[int, int] | None,
                    dropped: bool | None = None) -> Splice:
    """Exact history follows the template about reasoning. Where the template keeps a re-sent
    answer's reasoning, the sampled ids are spliced (``sp`` as it is). Where it drops it (the
    DeepSeek-R1 distills drop every earlier turn's; Qwen3 those before the last user message), the
    model is trained and served on the template's rendering: the answer is taken as rendered, after
    the matched call's own prompt ids, and the record says ``template_dropped_reasoning``; a prefix
    check that failed because the template now drops reasoning it had kept says so too.
    ``dropped``: the template renders the answer the same without its reasoning (asked of the
    server by rendering it both ways, ``ExactHistory._drops_reasoning``)."""
    if entry is None:
        return sp
    if sp.matched_call is not None and entry.answer.reasoning:
        if dropped:
            return Splice(list(entry.prompt_ids) + rendered[entry.rendered_len:], f"spliced_at={entry.n_messages}",
                          TEMPLATE_DROPPED_REASONING, f"call {entry.call_index}", matched_call=entry.call_index)
        return sp
    if think is not None and sp.cause == TEMPLATE_NOT_PREFIX and sp.matched_call is None:
        if rendered.count(think[1]) < entry.prompt_ids.count(think[1]):
            return Splice(sp.ids, sp.history, TEMPLATE_DROPPED_REASONING, sp.detail)
    return sp


def without_empty_think(rendered: list[int], think: tuple[int, int] | None) -> list[int]:
    """The rendered prompt without an empty think block its generation prompt ends with (Qwen3 with
    ``enable_thinking=false``: ``<think>\\n\\n</think>\\n\\n``). The template re-renders the answer without
    it, so the next call's prefix check compares what precedes it (it failed on every call)."""
    if think is None:
        return rendered
    tail = rendered[-6:]
    if think[0] in tail:
        i = len(rendered) - len(tail) + tail.index(think[0])
        if think[1] in rendered[i + 1:]:
            return rendered[:i]
    return rendered
