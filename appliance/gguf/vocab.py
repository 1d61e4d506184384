"""tokenizer.json and tokenizer_config.json from a GGUF file's vocabulary (appliance/gguf)."""

from __future__ import annotations

import json
from typing import Any

from appliance.gguf.meta import ImportRefused
from appliance.gguf.meta import meta_value as _meta

CONTROL = 3
"""GGUF token type of control tokens (special tokens the tokenizer never splits)."""


def _merge(line: str) -> tuple[str, str]:
    left, sep, right = line.partition(" ")
    if not sep:
        raise ImportRefused(f"the file's merges have an entry without two parts: {line!r}")
    return left, right


def tokenizer_files(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) for a byte-level BPE vocabulary (built here)
    or a SentencePiece one (built by transformers' GGUF tokenizer builders)."""
    kind = str(_meta(meta, "tokenizer.ggml.model"))
    if kind == "gpt2":
        tokenizer = _byte_level(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece(meta)
    else:
        raise ImportRefused(f"tokenizer model {kind!r} is not supported by the importer "
                            "(it builds byte-level BPE, 'gpt2', and SentencePiece, 'llama', "
                            "vocabularies)")
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        value = meta.get(key)
        return None if value is None else str(tokens[int(value.item())])

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"].item())
        if "tokenizer.ggml.add_bos_token" in meta else kind == "llama",
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(1 << 30),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = str(meta["tokenizer.chat_template"])
    return tokenizer, config


def _byte_level(meta: dict[str, Any]) -> dict[str, Any]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = [str(t) for t in _meta(meta, "tokenizer.ggml.tokens")]
    merges = [_merge(str(m)) for m in _meta(meta, "tokenizer.ggml.merges")]
    types = meta.get("tokenizer.ggml.token_type")
    kinds = types.tolist() if types is not None else [1] * len(tokens)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, kinds, strict=True) if k == CONTROL])
    return dict(json.loads(tok.to_str()))


def _sentencepiece(meta: dict[str, Any]) -> dict[str, Any]:
    """transformers' reading of a GGUF SentencePiece vocabulary (Llama 2, Gemma and Phi-3
    each have their own spaces and merges rules there), from the metadata MLX read."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError:
        raise ImportRefused("this file has a SentencePiece vocabulary ('llama'), and the "
                            "installed transformers cannot build one from a GGUF file "
                            "(it needs transformers 5)") from None
    tokens = [str(t) for t in _meta(meta, "tokenizer.ggml.tokens")]
    spec: dict[str, Any] = {"tokenizer_type": "llama", "tokens": tokens}
    for key, name in (("scores", "scores"), ("token_type", "token_type"), ("merges", "merges"),
                      ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("unknown_token_id", "unk_token_id"),
                      ("padding_token_id", "pad_token_id"),
                      ("add_space_prefix", "add_prefix_space")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            spec[name] = value.tolist() if hasattr(value, "tolist") else value
    if "scores" not in spec and "merges" not in spec:
        raise ImportRefused("the file's SentencePiece vocabulary has neither scores nor "
                            "merges (tokenizer.ggml.scores)")
    try:
        backend, _ = convert_gguf_tokenizer(str(_meta(meta, "general.architecture")), spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise ImportRefused(f"the file's SentencePiece vocabulary cannot be built: {exc}"
                            ) from None
    return dict(json.loads(backend.to_str()))
