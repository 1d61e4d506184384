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
    """(tokenizer.json, tokenizer_config.json) for a byte-level BPE or a SentencePiece
    vocabulary, built by transformers' GGUF tokenizer builders (a byte-level one here where
    transformers has none)."""
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
    """transformers' byte-level BPE builder where it is installed: it splits text before the
    merges as the file's ``tokenizer.ggml.pre`` says (Llama 3 and Qwen group digits by three,
    GPT-2 does not); else GPT-2's split, built here."""
    convert = _gguf_builders()
    if convert is not None:
        spec = _spec(meta, "gpt2")
        spec["merges"] = [str(m) for m in _meta(meta, "tokenizer.ggml.merges")]
        return _build(convert, meta, spec)
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


def _gguf_builders() -> Any:
    """transformers' ``convert_gguf_tokenizer`` (transformers 5), or None."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError:
        return None
    return convert_gguf_tokenizer


def _spec(meta: dict[str, Any], kind: str) -> dict[str, Any]:
    """The metadata MLX read, under the names transformers' builders take (their own GGUF
    reader needs torch)."""
    spec: dict[str, Any] = {"tokenizer_type": kind,
                            "tokens": [str(t) for t in _meta(meta, "tokenizer.ggml.tokens")]}
    for key, name in (("pre", "pre_tokenizer_type"), ("scores", "scores"),
                      ("token_type", "token_type"), ("bos_token_id", "bos_token_id"),
                      ("eos_token_id", "eos_token_id"), ("unknown_token_id", "unk_token_id"),
                      ("padding_token_id", "pad_token_id"),
                      ("add_space_prefix", "add_prefix_space")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            spec[name] = value.tolist() if hasattr(value, "tolist") else str(value)
    return spec


def _build(convert: Any, meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    try:
        backend, _ = convert(str(_meta(meta, "general.architecture")), spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise ImportRefused(f"the file's vocabulary cannot be built: {exc}") from None
    return dict(json.loads(backend.to_str()))


def _sentencepiece(meta: dict[str, Any]) -> dict[str, Any]:
    """transformers' reading of a GGUF SentencePiece vocabulary (Llama 2, Gemma and Phi-3
    each have their own spaces and merges rules there)."""
    convert = _gguf_builders()
    if convert is None:
        raise ImportRefused("this file has a SentencePiece vocabulary ('llama'), and the "
                            "installed transformers cannot build one from a GGUF file "
                            "(it needs transformers 5)")
    spec = _spec(meta, "llama")
    if "tokenizer.ggml.merges" in meta:
        spec["merges"] = [str(m) for m in meta["tokenizer.ggml.merges"]]
    if "scores" not in spec and "merges" not in spec:
        raise ImportRefused("the file's SentencePiece vocabulary has neither scores nor "
                            "merges (tokenizer.ggml.scores)")
    return _build(convert, meta, spec)
