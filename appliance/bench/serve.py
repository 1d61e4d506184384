"""Closed-loop streaming clients against a running daemon, and their figures.

At each concurrency C, C clients each send ``--requests`` streamed chat completions back to
back (greedy, a distinct prompt each, so no prompt-cache hit replays an answer). Per level:
output tokens per second over the level's wall time, TTFT p50/p95 (request sent → first
text chunk) and inter-token latency p50/p95 (gaps between text chunks). Token counts are the
server's ``usage`` (``stream_options.include_usage``), else the number of text chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from appliance.bench.args import API_KEY_ENV
from appliance.percentiles import percentile
from appliance.settings import Settings

QUESTIONS = (
    "What is a simple way to keep fresh herbs from wilting in the kitchen for a week?",
    "Our radiator knocks every morning when the heating comes on. What usually causes that?",
    "Suggest three quick vegetarian dinners a ten year old would enjoy.",
    "How often should I clean the filter of a dishwasher?",
    "Explain why the sky is blue during the day and red at sunset, as if to a child.",
    "What should a family pack in a small emergency kit for a two-day power cut in winter?",
    "How do I remove a day-old red wine stain from a light cotton tablecloth?",
    "Give me a fair weekly chore rota for two adults and two teenagers.",
)
class BenchError(Exception):
    """Why the benchmark cannot run (no daemon, a refused key): one line for the user."""


@dataclass(slots=True)
class Timing:
    """What the client saw of one streamed request; times in seconds since it was sent."""

    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def gaps(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass(frozen=True, slots=True)
class Level:
    """One concurrency level's figures (seconds; None where nothing was measured)."""

    concurrency: int
    requests: int
    errors: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    first_error: str | None = None


def summarize(concurrency: int, timings: Sequence[Timing], wall_s: float) -> Level:
    ok = [t for t in timings if t.error is None]
    tokens = sum(t.tokens for t in ok)
    ttfts = [t.chunk_times[0] for t in ok if t.chunk_times]
    gaps = [g for t in ok for g in t.gaps]
    first_error = next((t.error for t in timings if t.error is not None), None)
    return Level(concurrency=concurrency, requests=len(timings), errors=len(timings) - len(ok),
                 output_tokens=tokens, wall_s=wall_s,
                 tokens_per_s=tokens / wall_s if ok and wall_s > 0 else None,
                 ttft_p50_s=percentile(ttfts, 50, "linear"),
                 ttft_p95_s=percentile(ttfts, 95, "linear"),
                 itl_p50_s=percentile(gaps, 50, "linear"),
                 itl_p95_s=percentile(gaps, 95, "linear"), first_error=first_error)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def render_table(levels: Sequence[Level]) -> str:
    """A Markdown table, one row per level."""
    rows = ["| C | requests | errors | tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms "
            "| ITL p95 ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in levels:
        rate = "-" if lv.tokens_per_s is None else f"{lv.tokens_per_s:,.1f}"
        rows.append(f"| {lv.concurrency} | {lv.requests} | {lv.errors} | {rate} "
                    f"| {_ms(lv.ttft_p50_s)} | {_ms(lv.ttft_p95_s)} | {_ms(lv.itl_p50_s)} "
                    f"| {_ms(lv.itl_p95_s)} |")
    return "\n".join(rows)


def prompt(serial: int, words: int) -> str:
    text = f"(Question {serial}) {QUESTIONS[serial % len(QUESTIONS)]}"
    if words > 0:
        filler = QUESTIONS[(serial + 1) % len(QUESTIONS)].split()
        text += " Context: " + " ".join(filler[i % len(filler)] for i in range(words))
    return text


@dataclass(frozen=True, slots=True)
class Plan:
    url: str
    headers: dict[str, str]
    model: str | None
    concurrency: list[int]
    requests: int
    max_tokens: int
    prompt_words: int
    timeout_s: float


def body(plan: Plan, serial: int, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt(serial, plan.prompt_words)}],
        "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}}
    if plan.model is not None:
        out["model"] = plan.model
    return out


def text_in(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries generated text (an answer's or its thinking's)."""
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def one_request(client: httpx.AsyncClient, plan: Plan, payload: dict[str, Any]
                      ) -> Timing:
    timing = Timing()
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=payload) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                timing.error = f"HTTP {resp.status_code}: {detail}"
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):
                    timing.error = str(chunk["error"])[:200]
                    return timing
                if any(text_in(c) for c in chunk.get("choices") or []):
                    timing.chunk_times.append(time.perf_counter() - sent)
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    timing.usage_tokens = usage["completion_tokens"]
    except (httpx.HTTPError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"[:200]
    return timing


async def run_level(client: httpx.AsyncClient, plan: Plan, concurrency: int, first: int
                    ) -> Level:
    async def one_client(c: int) -> list[Timing]:
        serials = range(first + c * plan.requests, first + (c + 1) * plan.requests)
        return [await one_request(client, plan, body(plan, s, plan.max_tokens))
                for s in serials]

    start = time.perf_counter()
    per_client = await asyncio.gather(*(one_client(c) for c in range(concurrency)))
    wall = time.perf_counter() - start
    return summarize(concurrency, [t for ts in per_client for t in ts], wall)


async def check_daemon(client: httpx.AsyncClient, plan: Plan) -> tuple[dict[str, Any], str | None]:
    """The daemon's /health, and the model to ask for; BenchError when it cannot serve."""
    try:
        health = await client.get("/health")
    except httpx.TransportError as exc:
        raise BenchError(f"no daemon answers at {plan.url} ({type(exc).__name__}); start it "
                         "with `appliance serve`, or pass --url") from exc
    info = health.json() if health.headers.get("content-type", "").startswith(
        "application/json") else {}
    if health.status_code != 200:
        raise BenchError(f"the daemon at {plan.url} is not serving: "
                         f"{info.get('reason', health.status_code)}")
    models = await client.get("/v1/models")
    if models.status_code in (401, 403):
        raise BenchError(f"the daemon refused the API key (HTTP {models.status_code}): pass "
                         f"--api-key KEY or set {API_KEY_ENV} (`appliance key create NAME`)")
    model = plan.model
    if model is None and models.status_code == 200:
        data = models.json().get("data") or []
        model = data[0].get("id") if data and isinstance(data[0], dict) else None
    return info, model


async def measure(plan: Plan, warmup: bool) -> dict[str, Any]:
    timeout = httpx.Timeout(plan.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=max(plan.concurrency) + 2)
    async with httpx.AsyncClient(base_url=plan.url, headers=plan.headers, timeout=timeout,
                                 limits=limits) as client:
        health, model = await check_daemon(client, plan)
        plan = replace(plan, model=model)
        if warmup:  # absorbs lazy work (first compile, first allocation); not measured
            first = await one_request(client, plan, body(plan, 10_000, min(8, plan.max_tokens)))
            if first.error is not None:
                raise BenchError(f"the warm-up request failed: {first.error}")
        levels, serial = [], 0
        for concurrency in plan.concurrency:
            levels.append(await run_level(client, plan, concurrency, serial))
            serial += concurrency * plan.requests
            print(f"[bench] C={concurrency} done", file=sys.stderr, flush=True)
    return {"health": health, "model": model, "levels": levels}


def default_url(settings: Settings) -> str:
    host = settings.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.server.port}"


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Measure, print the table, write the JSON; 0 when every request succeeded."""
    key = args.api_key or os.environ.get(API_KEY_ENV)
    plan = Plan(url=(args.url or default_url(settings)).rstrip("/"),
                headers={"Authorization": f"Bearer {key}"} if key else {},
                model=args.model, concurrency=args.concurrency, requests=args.requests,
                max_tokens=args.max_tokens, prompt_words=max(0, args.prompt_words),
                timeout_s=args.timeout)
    started = dt.datetime.now(dt.UTC)
    try:
        result = asyncio.run(measure(plan, warmup=not args.no_warmup))
    except BenchError as exc:
        print(f"appliance bench: {exc}", file=sys.stderr)
        return 2
    levels: list[Level] = result["levels"]
    facts = {"date": started.isoformat(timespec="seconds"), "url": plan.url,
             "model": result["model"], "backend": result["health"].get("backend"),
             "max_batch_size": result["health"].get("max_batch_size"),
             "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
             "requests_per_client": plan.requests, "max_tokens": plan.max_tokens,
             "prompt_words": plan.prompt_words}
    print(f"{facts['model']} at {plan.url} on {facts['machine']}; {plan.requests} requests "
          f"per client, max_tokens {plan.max_tokens}, greedy\n")
    print(render_table(levels))
    for lv in levels:
        if lv.first_error:
            print(f"\nC={lv.concurrency}: {lv.errors} failed; first: {lv.first_error}")
    if args.json is not None:
        args.json.write_text(json.dumps(
            {**facts, "levels": [asdict(lv) for lv in levels]}, indent=2) + "\n")
    return 1 if any(lv.errors for lv in levels) else 0
