"""benchmarks/tune_tiny_r1_tools.py's examples: which tool it calls, and which answer each context is
taught (the fine-tuning itself is the benchmark's, minutes of CPU)."""

from __future__ import annotations

import pytest

from polar_runtime import models
from polar_testing.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def tune():
    return load_benchmark("tune_tiny_r1_tools")


def _tool(name: str, key: str, kind: str = "string") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {key: {"type": kind}}}}}


def test_the_shell_tool_and_its_argument_follow_the_request(tune):
    assert tune.shell_tool([_tool("read", "path"), _tool("bash", "command")]) == ("bash", {"command": "ls"})
    assert tune.shell_tool([_tool("exec_command", "cmd")]) == ("exec_command", {"cmd": "ls"})
    assert tune.shell_tool([_tool("shell", "command", "array")]) == ("shell", {"command": ["bash", "-lc", "ls"]})
    with pytest.raises(SystemExit, match="no shell tool"):
        tune.shell_tool([_tool("read", "path")])


def test_user_last_contexts_get_the_tool_call_and_tool_results_the_answer(tune):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models.ensure_model(models.TINY_R1)))
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "make notes.txt"}]
    tools = [_tool("bash", "command")]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    record = {"status": "ok", "prompt_token_ids": prompt, "normalized_request": {"messages": messages, "tools": tools}}
    pairs, built = tune.examples([record], tok, max_calls=3, outputs=2)
    assert built["tool"] == "bash" and built["rendered_equal"] == 1 and built["examples"] == len(pairs) == 5
    text = [(tok.decode(c), tok.decode(a)) for c, a in pairs]
    assert text[0][0] == tok.decode(prompt)
    for ctx, answer in text:
        assert answer.endswith(tok.eos_token)
        if ctx.endswith("<｜tool▁outputs▁end｜>"):  # the template adds no generation prompt after a tool result
            assert answer == "The command ran</think>Done" + tok.eos_token, ctx[-80:]
        else:
            assert ctx.endswith("<｜Assistant｜>")
            assert answer.startswith("<think>")
            assert '{"name": "bash","arguments":{"command":"ls"}}' in answer, ctx[-80:]
    assert sum(a.endswith("Done" + tok.eos_token) for _, a in text) == 2  # one answer per tool output taught


def test_each_answer_id_follows_from_the_one_before(tune):
    """No id repeats within a taught answer and the two answers share only ``</think>``: the chain a
    2-layer model must carry over an untaught 4k-id prompt (see ``TOOL_REASONING``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models.ensure_model(models.TINY_R1)))
    think_end = tok.convert_tokens_to_ids("</think>")
    final = tok(tune.FINAL_ANSWER, add_special_tokens=False)["input_ids"]
    for name, args in (("exec_command", {"cmd": "ls"}), ("bash", {"command": "ls"})):
        tool = tok(tune.TOOL_REASONING + tune.call_json(tok, name, args, avoid=tune.FINAL_ANSWER),
                   add_special_tokens=False)["input_ids"]
        assert len(set(tool)) == len(tool) and len(set(final)) == len(final)
        assert set(tool) & set(final) == {think_end} and tool[0] != final[0]


def test_training_on_tails_reports_the_whole_contexts(tune):
    """With ``tail``, steps see only each context's end, but the stop and the reported figure are
    the whole contexts' (what a live prompt of that length meets)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(str(models.ensure_model(models.TINY_R1)), dtype=torch.float32)
    pairs = [(list(range(1000, 1300)), [5, 6, 7]), (list(range(2000, 2300)), [8, 9])]
    fit = tune.train(model, pairs, max_steps=60, lr=1e-2, target=0.5, tail=16)
    assert fit["steps"] < 60 and fit["tail"] == 16 and fit["lowest_answer_prob"] > 0.5
    assert fit["lowest_answer_prob"] == round(tune.lowest_prob(model, pairs), 4)
    tails = [(c[-16:], a) for c, a in pairs]
    assert tune.lowest_prob(model, tails) != tune.lowest_prob(model, pairs)
