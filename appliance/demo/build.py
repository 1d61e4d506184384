"""Build a tiny, reproducible llama-architecture MLX model directory.

The appliance ships a small *demo model* so that a fresh machine with no network can still
serve chat end to end. This module builds it (and two other shapes used by tests and
benchmarks) into a directory that ``mlx_lm.load(path)`` opens like any downloaded model:
``config.json`` (``model_type: llama``, ``appliance_demo: true``), ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` (ChatML template), ``special_tokens_map.json``,
``generation_config.json`` and a ``README.md``.

The training text and its license: :mod:`appliance.demo.corpus`; the training loop and the
household lessons: :mod:`appliance.demo.train` and :mod:`appliance.demo.household`.

Shapes
------
``demo``         the shipped model: trained on the corpus as ChatML turns, then on synthetic
                 Home Assistant conversations (docs/demo-model.md).
``tiny``         2 layers, hidden 64, random weights: fast test fixtures.
``smollm-135m``  SmolLM-135M's exact shape with random weights, for benchmarks only. Its
                 byte-level BPE is trained for 49152 ids; if the corpus cannot supply that many
                 merges, the remaining ids are filled with ``<|reserved_special_token_N|>``
                 special tokens so that the vocabulary has exactly 49152 decodable ids. On the
                 committed corpus BPE stops at 7201 ids (min_frequency 2), so ids 7201-49151
                 are reserved specials; a random-weight model can sample them, so benchmarks
                 should ignore eos and not judge the text.
``smollm-135m-8k`` the same with an 8,192-token context, for long prompts (benchmarks only).

Usage::

    python -m appliance.demo.build --out DIR --shape demo|tiny|smollm-135m|smollm-135m-8k \
        [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)

from appliance.demo import household
from appliance.demo.corpus import CORPUS_PATH, load_corpus, make_corpus
from appliance.demo.template import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    PLAIN_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
)
from appliance.demo.train import (
    BATCH_SIZE,
    DEMO_HOUSEHOLD,
    SEQ_LEN,
    chat_examples,
    token_stream,
    train,
)

log = logging.getLogger(__name__)

DEMO_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = DEMO_DIR.parent / "demo_model"

RESERVED_TOKEN = "<|reserved_special_token_{}|>"
WORD_SPLIT = r"\p{L}+|\p{N}|[^\s\p{L}\p{N}]+|\s+"
"""The demo tokenizer's pieces: letters, single digits, punctuation runs, whitespace runs."""

@dataclass(frozen=True)
class Shape:
    """Architecture and build settings for one named shape."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    trained: bool = False
    tools: bool = False  # the tool-calling chat template and <tool_call> tokens
    train_steps: int = 0
    tokenizer_corpus_chars: int | None = None  # None: the whole corpus


SHAPES: dict[str, Shape] = {
    "demo": Shape(
        hidden_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=432,
        vocab_size=4096,
        max_position_embeddings=4096,
        trained=True,
        tools=True,
        train_steps=400,
    ),
    "tiny": Shape(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        tokenizer_corpus_chars=100_000,
    ),
    "smollm-135m": Shape(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        rms_norm_eps=1e-5,
    ),
}
SHAPES["smollm-135m-8k"] = replace(SHAPES["smollm-135m"], max_position_embeddings=8192)
"""The same shape with an 8,192-token context (as SmolLM2-135M-Instruct's), for prompts of
2k-4k tokens in the prefill benchmark; the same seed gives the same weights."""

# --------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(paragraphs: Sequence[str], vocab_size: int,
                    tool_tokens: bool = False) -> Tokenizer:
    """Train a deterministic byte-level BPE with exactly ``vocab_size`` ids (the last two
    the tool-call tags when ``tool_tokens``)."""
    tok = Tokenizer(models.BPE())
    if tool_tokens:
        # Words never carry the space before them (spaces are tokens of their own), so a
        # name is the same tokens in "turn on the kitchen light" and in {"name": "kitchen
        # light"}: a tool call copies the user's words instead of translating them.
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(WORD_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = TOOL_TOKENS if tool_tokens else ()
    learned = vocab_size - len(added)
    trainer = trainers.BpeTrainer(
        vocab_size=learned,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    missing = learned - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([RESERVED_TOKEN.format(i) for i in range(missing)])
        log.info("tokenizer padded with %d reserved special tokens", missing)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def _tokenizer_config(tok: Tokenizer, max_len: int, template: str) -> dict[str, Any]:
    added = {
        str(tok.token_to_id(t.content)): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t.special,
        }
        for t in tok.get_added_tokens_decoder().values()
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": dict(sorted(added.items(), key=lambda kv: int(kv[0]))),
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": IM_START,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "model_max_length": max_len,
        "pad_token": IM_END,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": ENDOFTEXT,
    }


def write_tokenizer(tok: Tokenizer, out: Path, max_len: int,
                    template: str = PLAIN_TEMPLATE) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok, max_len, template))
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [IM_START, IM_END],
            "bos_token": IM_START,
            "eos_token": IM_END,
            "pad_token": IM_END,
            "unk_token": ENDOFTEXT,
        },
    )


# --------------------------------------------------------------------------------------
# Model config and weights


def model_config(shape: str | Shape) -> dict[str, Any]:
    """The ``config.json`` dict for a shape (no weights, no files)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.hidden_size // s.num_attention_heads,
        "intermediate_size": s.intermediate_size,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
        "rope_theta": s.rope_theta,
        "rms_norm_eps": s.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": SPECIAL_TOKENS.index(IM_START),
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)],
        "pad_token_id": SPECIAL_TOKENS.index(IM_END),
        "torch_dtype": "float32",
        "appliance_demo": True,
    }


def init_model(config: dict[str, Any], seed: int) -> llama.Model:
    """A freshly initialised mlx_lm llama model (deterministic for a given seed)."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def save_weights(model: nn.Module, out: Path) -> None:
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


# --------------------------------------------------------------------------------------
# Build


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _readme(shape: str, seed: int, steps: int, final_loss: float | None) -> str:
    s = SHAPES[shape]
    plan = DEMO_HOUSEHOLD if s.tools and steps == s.train_steps else None
    if final_loss is None:
        trained = f"Random weights (seed {seed}); not trained."
    else:
        trained = (f"Trained for {steps} AdamW steps on the corpus (batch {BATCH_SIZE} x "
                   f"{SEQ_LEN} tokens, seed {seed}); final corpus loss {final_loss:.3f}.")
    if plan is not None:
        trained += f"""
- Then {plan.steps} household steps (every {plan.corpus_every}th still a corpus batch):
  synthetic Home Assistant conversations, learning the assistant turns only. The first
  {plan.copy_share:.0%} are {plan.batch} x {plan.short_len}-token rows of exchanges (devices
  often named by random words, so names are copied from the user's turn); the rest are
  rows of {plan.long_len} tokens that start with HA's Assist prompt and intent tools
  (`HassTurnOn`, `HassTurnOff`, `HassLightSet`, `GetLiveContext` and nine more).
- What it can do: with HA's request, commands on HA-style device names ("turn on the
  kitchen light", "turn off the lights in the kitchen") become the right tool call, and a
  tool result is answered with a short sentence. Devices named by arbitrary words are
  usually called by the wrong name, and free chat is English-looking text about Python,
  not answers. Use a real model (docs/home-assistant.md) for a real home."""
    tokenizer = (
        "Tokenizer: BPE trained with `tokenizers` on the corpus and household words; spaces "
        "are tokens of their own, so a\n  device name is the same tokens in a command and "
        "in a tool call; `<tool_call>`, `</tool_call>`\n  are the last two ids; a ChatML "
        "template with tools (mlx-lm's `json_tools` parser)"
        if s.tools else "Tokenizer: byte-level BPE trained with `tokenizers` on the corpus; "
        "ChatML chat template")
    return f"""# Appliance demo model ({shape})

This is a **demo model**, not a useful assistant: a tiny llama-architecture MLX model that
lets the appliance run end to end with no network.

- Shape: hidden {s.hidden_size}, {s.num_hidden_layers} layers, {s.num_attention_heads} heads, \
{s.num_key_value_heads} KV heads, intermediate {s.intermediate_size}, vocab {s.vocab_size}, \
context {s.max_position_embeddings}, tied embeddings, float32.
- {tokenizer}; special tokens `<|endoftext|>` (0), `<|im_start|>` (1), `<|im_end|>` (2);
  eos `<|im_end|>`.
- Corpus: `appliance/demo/corpus.txt`, prose from the CPython 3.11.7 standard
  library documentation and docstrings, Copyright (c) 2001-2023 Python Software Foundation,
  used under the PSF License Agreement.
- {trained}

Rebuild with (about an hour on a 2-core CPU for the demo shape):

    python -m appliance.demo.build --out DIR --shape {shape} --seed {seed}
"""


def build_model(
    out: Path, *, shape: str = "demo", seed: int = 0, train_steps: int | None = None,
    progress: Callable[[int, nn.Module], None] | None = None,
) -> Path:
    """Build the named shape into ``out`` (created if needed) and return ``out``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    s = SHAPES[shape]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    paragraphs = load_corpus()
    tok_text = paragraphs
    if s.tokenizer_corpus_chars is not None:
        tok_text, total = [], 0
        for para in paragraphs:
            if total >= s.tokenizer_corpus_chars:
                break
            tok_text.append(para)
            total += len(para)
    if s.tools:  # the household's words get tokens of their own too
        tok_text = [*tok_text, *household.tokenizer_texts(seed)]
    tok = train_tokenizer(tok_text, s.vocab_size, tool_tokens=s.tools)
    log.info("tokenizer %d ids in %.1f s", tok.get_vocab_size(), time.perf_counter() - t0)

    config = model_config(shape)
    model = init_model(config, seed)
    steps = s.train_steps if train_steps is None else train_steps
    final_loss = None
    if steps > 0:
        tokens = token_stream(tok, chat_examples(paragraphs, seed))
        log.info("training tokens %d", tokens.shape[0])
        plan = DEMO_HOUSEHOLD if s.tools and train_steps is None else None
        final_loss = train(model, tokens, steps, seed, tok, plan,
                           household.name_words(paragraphs), progress)

    save_weights(model, out)
    write_tokenizer(tok, out, s.max_position_embeddings,
                    CHAT_TEMPLATE if s.tools else PLAIN_TEMPLATE)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    (out / "README.md").write_text(_readme(shape, seed, steps, final_loss), encoding="utf-8")
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16]
    log.info("built in %.1f s, weights sha256 %s", time.perf_counter() - t0, digest)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny llama-architecture MLX model.")
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    parser.add_argument("--steps", type=int, default=None, help="training steps (demo only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--make-corpus", action="store_true", help="rewrite corpus.txt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.make_corpus:
        CORPUS_PATH.write_text(make_corpus(), encoding="utf-8")
        log.info("corpus %d bytes", CORPUS_PATH.stat().st_size)
    build_model(args.out, shape=args.shape, seed=args.seed, train_steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
