"""Training the demo model: the corpus as ChatML turns, then the household lessons
(:mod:`appliance.demo.household`), with AdamW on MLX. Deterministic for a seed on one
machine and BLAS (docs/demo-model.md)."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from tokenizers import Tokenizer

from appliance.backend import fast_ops
from appliance.demo import household
from appliance.demo.template import IM_END, IM_START

log = logging.getLogger(__name__)


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
    # MLX's own attention and SwiGLU: ours have no gradients, and the shipped weights are
    # what MLX's ops train (appliance/backend/fast_ops.py is a process-wide switch).
    fast_ops.uninstall()
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
