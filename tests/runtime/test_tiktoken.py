"""tiktoken encodings load offline from the cache built out of the bpe-openai package."""

from __future__ import annotations

import hashlib
import os

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry

from polar_core import paths
from polar_runtime import models


@pytest.mark.parametrize("name", models.TIKTOKEN_ENCODINGS)
def test_tiktoken_offline(name, monkeypatch):
    models.ensure_model(name, quiet=True)
    key, url, expected = models._tiktoken_cache_key(name)
    assert url.startswith("https://") and key == hashlib.sha1(url.encode()).hexdigest()
    cached = paths.tiktoken_cache_dir() / key
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == expected

    def no_network(blobpath):
        raise AssertionError(f"tiktoken tried to fetch {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # force a fresh load from the cache
    enc = models.tiktoken_encoding(name)
    assert os.environ["TIKTOKEN_CACHE_DIR"] == str(paths.tiktoken_cache_dir())
    text = "def add(a, b):\n    return a + b  # Ünïcödé ✓ 日本語"
    ids = enc.encode(text)
    assert enc.decode(ids) == text
    assert enc.n_vocab == {"o200k_base": 200019, "cl100k_base": 100277}[name]
    # reference ids published with tiktoken's own tests
    assert enc.encode("hello world") == {"o200k_base": [24912, 2375], "cl100k_base": [15339, 1917]}[name]
