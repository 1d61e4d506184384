"""The closed-loop streaming chat clients the serving benchmarks drive a server with: the
household questions, one distinct prompt per request, the request body, a level of C clients
sending N requests each (optionally staggered), the warm-up, and the model id a server
lists. `python -m bench.serve` (:mod:`bench.serve`) runs them against both servers;
the fairness, goodput and prefill benchmarks reuse the target, payload and warm-up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bench.client import RequestTiming, stream_chat
from bench.serve_stats import LevelStats, summarize_level

# Short household questions; each request prefixes a serial number so that no two requests
# of a run share a full prompt (neither server's prompt cache can replay an earlier answer).
QUESTIONS: tuple[str, ...] = (
    "What is a simple way to keep fresh herbs like basil and parsley from wilting in the "
    "kitchen for a whole week, without buying any special containers?",
    "Our living room radiator makes a loud knocking noise every morning when the heating "
    "comes on. What usually causes that, and is it something I can fix myself safely?",
    "Can you suggest three quick vegetarian dinners for a weeknight that a ten year old would "
    "enjoy and that need no more than thirty minutes of cooking?",
    "How often should I clean the filter of a dishwasher, and what are the signs that it "
    "needs cleaning sooner than the manual says?",
    "Explain in plain words why the sky looks blue during the day and turns red or orange "
    "around sunset, as if you were talking to a curious child.",
    "I want to start running in the mornings but I always give up after a week. What habits "
    "would help me keep going for at least two months?",
    "What should a family pack in a small emergency kit for a power cut that lasts two days "
    "in winter, and where should we keep it?",
    "Write a short friendly reminder message for the family group chat asking everyone to "
    "put their dirty dishes in the dishwasher instead of the sink.",
    "How do I remove a red wine stain from a light coloured cotton tablecloth if the stain is "
    "already a day old and has dried completely?",
    "What are the main differences between a heat pump and a gas boiler for heating a small "
    "house, in terms of running cost and comfort?",
    "Give me a simple weekly chore rota for a household of four people, two adults and two "
    "teenagers, that feels fair to everyone involved.",
    "Our tomato plants on the balcony have yellow leaves at the bottom. What could be wrong "
    "and what should I change about watering or feeding them?",
    "Summarise the rules of chess castling in a few sentences, including when a player is "
    "not allowed to castle at all during a game.",
    "What is a good bedtime routine for a toddler who keeps getting out of bed and asking for "
    "water, stories and hugs long after the lights go out?",
    "How can I tell whether eggs in the fridge are still good to eat, and how long do they "
    "usually keep once they have been bought from the shop?",
    "Suggest a few board games for a rainy afternoon with grandparents and young children "
    "playing together, with rules that can be learned in five minutes.",
)


def prompt_for(serial: int, words: int = 0, quote: bool = False) -> str:
    """The distinct prompt of the `serial`-th request of a run; with ``words``, the question
    is followed by that many filler words (a longer prompt of a stated length). ``quote``:
    the request is to repeat two of the questions word for word (text an answer quotes, as
    a summary quotes its document)."""
    if quote:
        text = " ".join(QUESTIONS[(serial + i) % len(QUESTIONS)] for i in range(2))
        return f"(Request {serial}) Repeat the following text exactly, word for word:\n\n{text}"
    text = f"(Question {serial}) {QUESTIONS[serial % len(QUESTIONS)]}"
    if words > 0:
        filler = QUESTIONS[(serial + 1) % len(QUESTIONS)].split()
        text += " Context: " + " ".join(filler[i % len(filler)] for i in range(words))
    return text


@dataclass
class Workload:
    concurrency: list[int]
    requests_per_client: int
    max_tokens: int
    include_usage: bool
    warmup: bool
    request_timeout_s: float
    prompt_words: int = 0
    """Filler words after each question (0: the question alone, about 40 tokens)."""
    stagger_ms: float = 0.0
    """> 0: every level also runs with its clients starting this many ms apart."""
    quote: bool = False
    """Each request asks for a text to be repeated (:func:`prompt_for`)."""


@dataclass
class Target:
    """How to talk to one running server."""

    name: str
    base_url: str
    headers: dict[str, str]
    model: str | None


def chat_payload(
    target: Target, prompt: str, max_tokens: int, include_usage: bool
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    if target.model is not None:
        payload["model"] = target.model
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    return payload


async def client_loop(
    client: httpx.AsyncClient,
    target: Target,
    workload: Workload,
    client_id: int,
    serials: Sequence[int],
    delay_s: float = 0.0,
) -> list[RequestTiming]:
    """One client: after `delay_s`, its requests strictly one after another."""
    url = f"{target.base_url}/v1/chat/completions"
    timings = []
    await asyncio.sleep(delay_s)
    for index, serial in enumerate(serials):
        payload = chat_payload(
            target, prompt_for(serial, workload.prompt_words, workload.quote),
            workload.max_tokens,
            workload.include_usage
        )
        timings.append(
            await stream_chat(
                client, url, payload, target.headers, client_id=client_id, index=index
            )
        )
    return timings


def level_serials(level_offset: int, concurrency: int, per_client: int) -> list[list[int]]:
    """Request serials of each client at one level: distinct across the whole run."""
    return [
        [level_offset + client * per_client + j for j in range(per_client)]
        for client in range(concurrency)
    ]


async def run_level(
    target: Target, workload: Workload, concurrency: int, level_offset: int,
    stagger_s: float = 0.0,
) -> tuple[LevelStats, list[RequestTiming]]:
    """All clients of one level; client i starts i × `stagger_s` after the first."""
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(workload.request_timeout_s, connect=30.0)
    serials = level_serials(level_offset, concurrency, workload.requests_per_client)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        per_client = await asyncio.gather(
            *(client_loop(client, target, workload, i, serials[i], i * stagger_s)
              for i in range(concurrency))
        )
        wall = time.perf_counter() - start
    timings = [t for client_timings in per_client for t in client_timings]
    return summarize_level(concurrency, timings, wall), timings


async def warm_up(target: Target, workload: Workload) -> None:
    """One lone request, then one burst at the highest concurrency; not measured.

    The first request also absorbs lazy model loading (mlx_lm loads in its generation thread
    after `/health` already answers). A failure here aborts this server's run.
    """
    burst = max(workload.concurrency)
    short = Workload(
        concurrency=[burst],
        requests_per_client=1,
        max_tokens=min(8, workload.max_tokens),
        include_usage=workload.include_usage,
        warmup=True,
        request_timeout_s=max(workload.request_timeout_s, 300.0),
    )
    for concurrency in (1, burst):
        stats, timings = await run_level(
            target, short, concurrency, level_offset=-1000 * concurrency
        )
        if stats.errors:
            raise RuntimeError(f"warm-up request failed on {target.name}: {stats.first_error}")


async def discover_model(target: Target) -> str | None:
    """The first id of `GET /v1/models`, or None when the server lists nothing."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        try:
            resp = await client.get(f"{target.base_url}/v1/models", headers=target.headers)
            data = resp.json().get("data") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model_id = data[0].get("id")
        return model_id if isinstance(model_id, str) else None
    return None
