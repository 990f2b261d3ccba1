"""Loading a model's tokenizer prints no Mistral-regex warning for a model that is not Mistral.

transformers 4.57.6 warns "The tokenizer you are loading from ... with an incorrect regex pattern"
for every local model saved by a 4.57.3+ transformers (``polar_core.tokenizer_identity.load_tokenizer``
says why); ``polar demo`` printed it for Qwen's tokenizer. A small tokenizer directory saved as
``polar models build`` saves its models (``config.json`` with ``model_type: qwen2`` and this
transformers' version; a vocabulary past 100k ids and a pre-tokenizer, as Qwen's) is loaded both ways: plainly the warning is there (the trigger still exists),
through ``load_tokenizer`` it is not, and the ids are the same.
"""

from __future__ import annotations

import json
import logging

import pytest

from polar_core.tokenizer_identity import fingerprint, load_tokenizer

WARNING = "with an incorrect regex pattern"


@pytest.fixture(scope="module")
def qwen_like_dir(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = tmp_path_factory.mktemp("tok")
    vocab = {"<unk>": 0, "hello": 1, "world": 2, "<|im_end|>": 3}
    vocab.update({f"t{i}": i for i in range(4, 100_010)})  # transformers looks only past 100k ids
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "unk_token": "<unk>", "eos_token": "<|im_end|>"}))
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "transformers_version": transformers.__version__}))
    return out


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def take(self) -> str:
        out, self.messages = "\n".join(self.messages), []
        return out


def test_load_tokenizer_prints_no_mistral_regex_warning(qwen_like_dir):
    from transformers import AutoTokenizer

    seen = Records()  # on transformers' own logger: it does not propagate to the root one
    logging.getLogger("transformers").addHandler(seen)
    try:
        plain = AutoTokenizer.from_pretrained(str(qwen_like_dir))
        if WARNING not in seen.take():
            pytest.skip("this transformers no longer misreads a non-Mistral model as Mistral: nothing to silence")
        ours = load_tokenizer(qwen_like_dir)
        assert WARNING not in seen.take()
    finally:
        logging.getLogger("transformers").removeHandler(seen)
    assert ours("hello world")["input_ids"] == plain("hello world")["input_ids"] == [1, 2]
    assert fingerprint(ours) == fingerprint(plain)
