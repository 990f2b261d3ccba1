"""Which tokenizer a model's token ids belong to: a fingerprint that trajectories carry and the
trainer checks before it trains on them.

Why: captured token ids are only meaningful under the tokenizer that produced them. Trained on
another model's ids, a smaller vocabulary crashes inside ``torch.embedding`` (``IndexError: index
out of range in self``) and a larger one silently trains on other tokens. So a trajectory Parquet
records the served model's name and this fingerprint, and ``polar train`` refuses a model whose
tokenizer's fingerprint differs (naming both).

What is hashed: the vocabulary, id -> the token's own spelling of its bytes (the byte-level BPE
or sentencepiece string, a bijection of the bytes for a given tokenizer family), and the ids of
its special tokens. Deliberately not hashed: the chat template (a fine-tune may change it without
changing a single id), which special token ends a turn (base and instruct models differ there),
and the model's embedding rows (padded to a multiple: Qwen2.5 0.5B has 151,936, the 7B 152,064,
with one tokenizer), so every size of one family shares the fingerprint.

No dependency: the tokenizer object is duck-typed (a ``transformers`` tokenizer).
"""

from __future__ import annotations

import hashlib
from typing import Any

#: bumped when what is hashed changes (an old fingerprint then reads as "another tokenizer")
VERSION = "tok1"


def special_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's special tokens: the added tokens flagged special (the vocabulary's
    own list, whichever of them a model's config names its end of turn), else ``all_special_ids``."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    if not ids:
        ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    return sorted(ids)


def is_padding(token_id: int, token: str | None) -> bool:
    """A row that only pads the vocabulary to the embedding's size: no token at all, or the
    ``[PAD<id>]`` placeholders a GGUF conversion writes (our Qwen2.5-Coder-0.5B's tokenizer lists
    151,936 ids, of which 151,665 are tokens)."""
    return token is None or token == f"[PAD{token_id}]"


def fingerprint(tokenizer: Any) -> str:
    """``tok1:<tokens>:<sha256 prefix>`` of the id -> token map (trailing padding rows left out)
    and the special ids."""
    n = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    while n and is_padding(n - 1, tokens[n - 1]):
        n -= 1
    tokens = tokens[:n]
    h = hashlib.sha256()
    for i, t in enumerate(tokens):
        h.update(b"%d\x00" % i)
        h.update((t if t is not None else "\x00<none>").encode("utf-8", "surrogatepass"))
        h.update(b"\x01")
    h.update(b"special:" + ",".join(str(i) for i in special_ids(tokenizer) if i < n).encode())
    return f"{VERSION}:{n}:{h.hexdigest()[:24]}"


def load_tokenizer(model_dir: Any, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir)``, without a Mistral warning that does not apply.

    transformers 4.57.6 (the main venv's, ``transformers<5``) takes *every* local model whose
    ``config.json`` was written by a transformers newer than 4.57.2 and older than 5 for a Mistral
    tokenizer with a wrong pre-tokenizer regex (its model_type check only runs for older
    versions), and logs "The tokenizer you are loading from
    ... with an incorrect regex pattern" unless ``fix_mistral_regex`` is given: every Qwen model
    ``polar models build`` saves got it, on every load, the trainer's in ``polar demo`` among them.
    ``fix_mistral_regex=False`` says "load it as published", which is what that version does
    anyway when the flag is absent (only the warning differs), and what the server tokenizes with:
    the ids Polar trains on are vLLM's, so a tokenizer here must never re-split text differently.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), fix_mistral_regex=False, **kwargs)


def fingerprint_of_dir(model_dir: Any) -> str | None:
    """The fingerprint of a model directory's tokenizer; None when it has none that loads."""
    try:
        return fingerprint(load_tokenizer(model_dir, local_files_only=True))
    except Exception:  # noqa: BLE001 - no tokenizer files: nothing to compare
        return None
