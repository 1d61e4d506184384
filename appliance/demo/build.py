"""Build a tiny, reproducible llama-architecture MLX model directory.

The appliance ships a small *demo model* so that a fresh machine with no network can still
serve chat end to end. This module builds it (and two other shapes used by tests and
benchmarks) into a directory that ``mlx_lm.load(path)`` opens like any downloaded model:
``config.json`` (``model_type: llama``, ``appliance_demo: true``), ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` (ChatML template), ``special_tokens_map.json``,
``generation_config.json`` and a ``README.md``.

Corpus source and license
-------------------------
The training text, ``appliance/demo/corpus.txt``, is derived from CPython 3.11.7's
standard library: the reference documentation shipped in ``Lib/pydoc_data/topics.py`` and the
docstrings of the pure-Python modules under ``Lib/``, filtered down to English prose
paragraphs by :func:`make_corpus`. That text is Copyright (c) 2001-2023 Python Software
Foundation; All Rights Reserved, and is redistributed here under the PSF License Agreement
for Python 3.11 (https://docs.python.org/3.11/license.html), whose notice is kept at the top of
the corpus file. The committed file is what the build uses; :func:`make_corpus` re-creates it
from the running interpreter's standard library (byte-identical only on CPython 3.11.7).

Shapes
------
``demo``         the shipped model: trained briefly on the corpus as ChatML turns.
``tiny``         2 layers, hidden 64, random weights: fast test fixtures.
``smollm-135m``  SmolLM-135M's exact shape with random weights, for benchmarks only. Its
                 byte-level BPE is trained for 49152 ids; if the corpus cannot supply that many
                 merges, the remaining ids are filled with ``<|reserved_special_token_N|>``
                 special tokens so that the vocabulary has exactly 49152 decodable ids. On the
                 committed corpus BPE stops at 7201 ids (min_frequency 2), so ids 7201-49151
                 are reserved specials; a random-weight model can sample them, so benchmarks
                 should ignore eos and not judge the text.

Usage::

    python -m appliance.demo.build --out DIR --shape demo|tiny|smollm-135m \
        [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import random
import re
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
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
from appliance.demo.template import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    PLAIN_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
)

log = logging.getLogger(__name__)

DEMO_DIR = Path(__file__).resolve().parent
CORPUS_PATH = DEMO_DIR / "corpus.txt"
DEMO_MODEL_DIR = DEMO_DIR.parent / "demo_model"

RESERVED_TOKEN = "<|reserved_special_token_{}|>"
WORD_SPLIT = r"\p{L}+|\p{N}|[^\s\p{L}\p{N}]+|\s+"
"""The demo tokenizer's pieces: letters, single digits, punctuation runs, whitespace runs."""

CORPUS_HEADER = """\
# corpus.txt: training text for the appliance demo model.
#
# Source: CPython 3.11.7 standard library -- the reference documentation in
# Lib/pydoc_data/topics.py and docstrings of the pure-Python modules in Lib/.
# Changes made (PSF License clause 3): paragraphs were extracted, filtered to English prose
# (code, grammar, tables and examples removed), de-duplicated, and their line breaks joined,
# by appliance.demo.build.make_corpus().
#
# Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved.
# Redistributed under the PSF License Agreement for Python 3.11, reproduced below.
# Lines starting with '#' are not training text; paragraphs are separated by blank lines.
#
"""


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

@dataclass(frozen=True)
class HouseholdPlan:
    """The household lessons: after the corpus steps, ``steps`` more in which every
    ``corpus_every``-th step is still a corpus batch (so plain chat keeps working) and the
    others are batches of Home Assistant conversations, learning the assistant turns only.
    A curriculum in two parts, by token budget per step (``batch`` x ``short_len``):
    - the first ``copy_share`` of the steps are rows of ``short_len`` tokens holding only
      exchanges, most devices named by random words: many short copies, which is how the
      model learns to take a device's name from the user's words;
    - the rest are rows of ``long_len`` tokens that start with a system prompt and the
      tools, ``full_share`` of them HA's whole prompt and device list."""

    steps: int
    batch: int = 12
    short_len: int = 256
    long_len: int = 1536
    corpus_every: int = 4
    copy_share: float = 0.7
    full_share: float = 0.8

    def rows(self, k: int) -> tuple[int, int, bool]:
        """(rows, tokens per row, whether rows start with a prompt) of household step k."""
        if k <= self.copy_share * self.steps:
            return self.batch, self.short_len, False
        return max(1, self.batch * self.short_len // self.long_len), self.long_len, True


# Training hyper-parameters for the demo shape.
DEMO_HOUSEHOLD = HouseholdPlan(steps=1800)
BATCH_SIZE = 16
SEQ_LEN = 128
LEARNING_RATE = 1e-3
WARMUP_STEPS = 50
WEIGHT_DECAY = 0.01

USER_PROMPTS: tuple[str, ...] = (
    "What is {w}?",
    "Tell me about {w}.",
    "Explain {w}.",
    "What do you know about {w}?",
    "Can you describe {w}?",
    "Say something about {w}.",
)
GENERIC_PROMPTS: tuple[str, ...] = (
    "Hello!",
    "Tell me something.",
    "Tell me a fact.",
    "What can you tell me?",
    "Say something interesting.",
    "Hi, who are you?",
)
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a small demo model.",
    "Answer briefly.",
)


# --------------------------------------------------------------------------------------
# Corpus


def _is_prose(paragraph: str) -> bool:
    """Heuristic: a paragraph of English sentences, not code, grammar or a table."""
    lines = paragraph.splitlines()
    if any(line[:1].isspace() for line in lines):
        return False
    text = " ".join(line.strip() for line in lines)
    if len(text) < 60 or len(text) > 2000 or not text[0].isupper():
        return False
    if text[-1] not in ".!?" or text.endswith("::") or text.endswith(":"):
        return False
    if re.search(r">>>|\.\.\.\s|::=|\*\*\*|===|---|~~~|\\n|\{\}|\w\(\)|[{}<>|@$#`\\]", text):
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    if letters / len(text) < 0.9:
        return False
    words = text.split()
    if len(words) < 10:
        return False
    odd = sum(1 for w in words if re.search(r"[_=\[\]()*]|\w\.\w", w))
    return odd / len(words) < 0.05 and text.isascii()


def _paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        block = block.strip("\n")
        if block and _is_prose(block):
            yield " ".join(line.strip() for line in block.splitlines())


def _docstrings(source: str) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _stdlib_files(stdlib: Path) -> list[Path]:
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "pydoc_data"}
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if skip.intersection(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        files.append(path)
    return files


def _psf_license(stdlib: Path) -> str:
    """The PSF License Agreement section of CPython's LICENSE.txt, as '#' comment lines."""
    text = (stdlib / "LICENSE.txt").read_text(encoding="utf-8")
    start = text.index("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    end = text.index("BEOPEN.COM LICENSE AGREEMENT", start)
    lines = text[start:end].strip().splitlines()
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def make_corpus(stdlib_dir: Path | None = None, max_chars: int = 1_200_000) -> str:
    """Re-create the text of ``corpus.txt`` from the interpreter's standard library."""
    stdlib = stdlib_dir or Path(sysconfig.get_paths()["stdlib"])
    header = CORPUS_HEADER + _psf_license(stdlib)
    topics_ns: dict[str, Any] = {}
    exec((stdlib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"), topics_ns)
    sources = [topics_ns["topics"][key] for key in sorted(topics_ns["topics"])]
    for path in _stdlib_files(stdlib):
        sources.extend(_docstrings(path.read_text(encoding="utf-8", errors="replace")))
    seen: set[str] = set()
    kept: list[str] = []
    total = 0
    for text in sources:
        for para in _paragraphs(text):
            if para in seen:
                continue
            seen.add(para)
            kept.append(para)
            total += len(para) + 2
            if total >= max_chars:
                return header + "\n" + "\n\n".join(kept) + "\n"
    return header + "\n" + "\n\n".join(kept) + "\n"


def load_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """The corpus paragraphs (header comment lines dropped)."""
    text = path.read_text(encoding="utf-8")
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return [p.strip() for p in body.split("\n\n") if p.strip()]


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
# Training data and loop (demo shape)


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph) if s]


def _answer(paragraph: str, rng: random.Random) -> str:
    sents = _sentences(paragraph)
    start = rng.randrange(len(sents))
    answer = sents[start]
    for sent in sents[start + 1 : start + rng.randint(1, 3)]:
        if len(answer) + len(sent) > 320:
            break
        answer += " " + sent
    return answer


def chat_examples(paragraphs: Sequence[str], seed: int, repeats: int = 2) -> list[str]:
    """Corpus sentences wrapped as ChatML conversations (rendered with CHAT_TEMPLATE)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(repeats):
        for para in paragraphs:
            answer = _answer(para, rng)
            words = re.findall(r"[a-z]{5,}", answer)
            if words and rng.random() < 0.7:
                user = rng.choice(USER_PROMPTS).format(w=rng.choice(words))
            else:
                user = rng.choice(GENERIC_PROMPTS)
            text = ""
            if rng.random() < 0.25:
                text += f"{IM_START}system\n{rng.choice(SYSTEM_PROMPTS)}{IM_END}\n"
            text += f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"
            examples.append(text)
    rng.shuffle(examples)
    return examples


def token_stream(tok: Tokenizer, examples: Sequence[str]) -> mx.array:
    ids: list[int] = []
    for enc in tok.encode_batch(list(examples), add_special_tokens=False):
        ids.extend(enc.ids)
    return mx.array(ids, dtype=mx.int32)


def _batches(tokens: mx.array, steps: int, seed: int) -> Iterator[mx.array]:
    rng = random.Random(seed)
    hi = tokens.shape[0] - SEQ_LEN - 1
    offsets = mx.arange(SEQ_LEN + 1)
    for _ in range(steps):
        starts = mx.array([rng.randrange(hi) for _ in range(BATCH_SIZE)])
        yield tokens[starts[:, None] + offsets[None, :]]


def _loss(model: nn.Module, batch: mx.array) -> mx.array:
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def _schedule(steps: int) -> Callable[[mx.array], mx.array]:
    warmup = min(WARMUP_STEPS, max(1, steps // 10))
    return optim.join_schedules(
        [
            optim.linear_schedule(LEARNING_RATE / 100, LEARNING_RATE, warmup),
            optim.cosine_decay(LEARNING_RATE, max(1, steps - warmup), LEARNING_RATE / 10),
        ],
        [warmup],
    )


def _masked_loss(model: nn.Module, batch: mx.array, mask: mx.array) -> mx.array:
    logits = model(batch[:, :-1])
    losses = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="none")
    weights = mask[:, 1:]
    return (losses * weights).sum() / mx.maximum(weights.sum(), 1.0)


def train(model: nn.Module, tokens: mx.array, steps: int, seed: int,
          tok: Tokenizer | None = None, plan: HouseholdPlan | None = None,
          words: Sequence[str] = (),
          progress: Callable[[int, nn.Module], None] | None = None) -> float:
    """Next-token training with AdamW; returns the mean loss of the last 50 corpus steps.
    With ``plan`` (and the tokenizer), household steps follow the corpus steps, naming
    devices by ``words`` too. ``progress(step, model)`` runs every 100 steps (for
    experiments; it must not change the model)."""
    mx.random.seed(seed)
    house_steps = plan.steps if plan is not None and tok is not None else 0
    opt = optim.AdamW(learning_rate=_schedule(steps + house_steps), weight_decay=WEIGHT_DECAY)
    loss_and_grad = nn.value_and_grad(model, _loss)
    masked_and_grad = nn.value_and_grad(model, _masked_loss)
    state = [model.state, opt.state]

    def step_fn(batch: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, batch)
        opt.update(model, grads)
        return loss

    def house_fn(batch: mx.array, mask: mx.array) -> mx.array:
        loss, grads = masked_and_grad(model, batch, mask)
        opt.update(model, grads)
        return loss

    step = mx.compile(step_fn, inputs=state, outputs=state)
    house_step = mx.compile(house_fn, inputs=state, outputs=state)
    corpus = _batches(tokens, steps + house_steps, seed)
    rng = random.Random(seed)
    recent: list[float] = []
    recent_house: list[float] = []
    t0 = time.perf_counter()
    for i in range(1, steps + house_steps + 1):
        k = i - steps  # household step number (from 1)
        if plan is not None and tok is not None and k > 0 and k % plan.corpus_every:
            n, length, head = plan.rows(k)
            rows, masks = household.training_rows(
                tok, rng, n, length, plan.full_share, words, head)
            loss = house_step(rows, masks)
            mx.eval(state, loss)
            recent_house = (recent_house + [float(loss)])[-20:]
        else:
            loss = step(next(corpus))
            mx.eval(state, loss)
            recent = (recent + [float(loss)])[-50:]
        if i % 20 == 0 or i == steps + house_steps:
            log.info("step %d/%d corpus loss %.3f household loss %.3f (%.0f s)", i,
                     steps + house_steps, sum(recent) / max(1, len(recent)),
                     sum(recent_house) / max(1, len(recent_house)), time.perf_counter() - t0)
        if progress is not None and i % 100 == 0:
            progress(i, model)
    return sum(recent) / max(1, len(recent))


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
