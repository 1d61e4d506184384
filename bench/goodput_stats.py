"""The pure part of `python -m bench.goodput`: the household mix, its seeded open-loop
arrival schedule, the per-class SLOs, attainment per rate, goodput and the frontier.

The mix (shares of arrivals; lengths uniform in the stated ranges, prompts in words, which
the benchmark models' tokenizer turns into about 2.5 tokens each, so a document is about
750-1,750 tokens and fits a 2,048-token context):

| class | share | prompt words | output tokens | SLO |
|---|---:|---|---|---|
| voice (a spoken command) | 30 % | 4-12 | 8-24 | TTFT <= 1.5 s |
| chat (a typed turn) | 55 % | 10-60 | 32-96 | TTFT <= 3 s and ITL p95 <= 0.5 s |
| document (background summary) | 15 % | 300-700 | 48-96 | done within 120 s |

``--slo-scale`` multiplies every SLO time (a faster machine can hold tighter ones).
Arrivals are a Poisson process (exponential gaps) at each rate, from one seed, so both
servers see exactly the same requests at the same offsets.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from appliance.percentiles import percentile
from appliance.vocab import Klass

GOODPUT_SHARE = 0.9
"""A rate counts towards goodput when at least this share of its requests met their SLO."""


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    share: float
    prompt_words: tuple[int, int]
    output_tokens: tuple[int, int]
    header: str
    """Our server's ``x-appliance-class`` (others ignore it)."""
    ttft_s: float | None = None
    itl_p95_s: float | None = None
    total_s: float | None = None


MIX: tuple[RequestClass, ...] = (
    RequestClass("voice", 0.30, (4, 12), (8, 24), Klass.VOICE.label, ttft_s=1.5),
    RequestClass("chat", 0.55, (10, 60), (32, 96), Klass.INTERACTIVE.label, ttft_s=3.0,
                 itl_p95_s=0.5),
    RequestClass("document", 0.15, (300, 700), (48, 96), Klass.BACKGROUND.label, total_s=120.0),
)
CLASSES = {c.name: c for c in MIX}


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    klass: str
    prompt_words: int
    max_tokens: int
    serial: int


def schedule(rate: float, duration_s: float, seed: int,
             mix: Sequence[RequestClass] = MIX) -> list[Arrival]:
    """Poisson arrivals at ``rate`` per second over ``duration_s``; each one's class and
    lengths drawn from ``mix``. The same (rate, duration, seed) always gives the same list."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = random.Random(f"{seed}:{rate}")
    weights = [c.share for c in mix]
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        c = rng.choices(mix, weights)[0]
        out.append(Arrival(at_s=t, klass=c.name, prompt_words=rng.randint(*c.prompt_words),
                           max_tokens=rng.randint(*c.output_tokens), serial=len(out)))
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the client saw of one request (seconds from sending it)."""

    klass: str
    ok: bool
    ttft_s: float | None
    total_s: float
    itls: tuple[float, ...] = ()
    sent_s: float = 0.0
    """When it was sent, from the start of its rate's run."""
    error: str | None = None


def meets_slo(o: Outcome, scale: float = 1.0, classes: Mapping[str, RequestClass] = CLASSES
              ) -> bool:
    c = classes[o.klass]
    if not o.ok:
        return False
    if c.ttft_s is not None and (o.ttft_s is None or o.ttft_s > c.ttft_s * scale):
        return False
    if c.itl_p95_s is not None:
        tail = percentile(o.itls, 95)
        if tail is not None and tail > c.itl_p95_s * scale:
            return False
    return c.total_s is None or o.total_s <= c.total_s * scale


@dataclass(frozen=True, slots=True)
class RateResult:
    rate: float
    requests: int
    attainment: float
    by_class: dict[str, float]
    """Share meeting the SLO per class (classes with requests only)."""
    mean_in_flight: float
    """Average requests in flight over the run (Little's law: the batch the server held)."""
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p95_s: float | None
    errors: int = 0
    first_error: str | None = None


def summarize_rate(rate: float, outcomes: Sequence[Outcome], scale: float = 1.0) -> RateResult:
    met = [meets_slo(o, scale) for o in outcomes]
    by_class: dict[str, float] = {}
    for name in CLASSES:
        mine = [m for o, m in zip(outcomes, met, strict=True) if o.klass == name]
        if mine:
            by_class[name] = sum(mine) / len(mine)
    span = (max((o.sent_s + o.total_s for o in outcomes), default=0.0)
            - min((o.sent_s for o in outcomes), default=0.0))
    busy = sum(o.total_s for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    itls = [g for o in outcomes for g in o.itls]
    return RateResult(
        rate=rate, requests=len(outcomes),
        attainment=sum(met) / len(met) if met else 0.0, by_class=by_class,
        mean_in_flight=busy / span if span > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        itl_p95_s=percentile(itls, 95), errors=sum(not o.ok for o in outcomes),
        first_error=next((o.error for o in outcomes if o.error), None))


def goodput(results: Sequence[RateResult], share: float = GOODPUT_SHARE) -> float | None:
    """The highest rate at which, and at every lower rate tested, at least ``share`` of the
    requests met their SLO; None when even the lowest rate misses."""
    best = None
    for r in sorted(results, key=lambda r: r.rate):
        if r.requests == 0 or r.attainment < share:
            break
        best = r.rate
    return best


def goodput_ratio(ours: float | None, reference: float | None,
                  lowest_rate: float) -> tuple[float | None, str]:
    """ours / reference, with a note when either side missed even the lowest rate (then
    the ratio is bounded, not measured)."""
    if ours is None and reference is None:
        return None, "neither met the SLO share at the lowest rate"
    if reference is None:
        return None, f"only ours met it (reference < {lowest_rate:g}/s)"
    if ours is None:
        return 0.0, f"only the reference met it (ours < {lowest_rate:g}/s)"
    return ours / reference, ""
