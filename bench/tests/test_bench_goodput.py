"""The goodput benchmark's statistics: schedule, SLOs, attainment, goodput (pure)."""

from __future__ import annotations

import pytest

from appliance.percentiles import percentile
from bench.goodput_stats import (
    CLASSES,
    MIX,
    Outcome,
    RateResult,
    goodput,
    goodput_ratio,
    meets_slo,
    schedule,
    summarize_rate,
)


def test_the_schedule_is_seeded_and_poisson_at_the_rate() -> None:
    a = schedule(2.0, 2000.0, seed=7)
    assert a == schedule(2.0, 2000.0, seed=7)
    assert a != schedule(2.0, 2000.0, seed=8)
    assert len(a) == pytest.approx(4000, rel=0.05)
    gaps = [y.at_s - x.at_s for x, y in zip(a, a[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.5, rel=0.05)
    # exponential gaps: the standard deviation equals the mean
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert sd == pytest.approx(mean, rel=0.1)
    assert all(0 <= x.at_s < 2000 for x in a)


def test_the_mix_follows_its_shares_and_length_ranges() -> None:
    a = schedule(5.0, 2000.0, seed=1)
    for c in MIX:
        mine = [x for x in a if x.klass == c.name]
        assert len(mine) / len(a) == pytest.approx(c.share, abs=0.02)
        assert all(c.prompt_words[0] <= x.prompt_words <= c.prompt_words[1] for x in mine)
        assert all(c.output_tokens[0] <= x.max_tokens <= c.output_tokens[1] for x in mine)


def test_schedule_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        schedule(0.0, 10.0, seed=1)


def voice(ttft: float | None, ok: bool = True) -> Outcome:
    return Outcome("voice", ok, ttft, total_s=(ttft or 0) + 0.5)


def test_a_voice_request_meets_its_slo_on_ttft() -> None:
    limit = CLASSES["voice"].ttft_s
    assert limit is not None
    assert meets_slo(voice(limit - 0.01))
    assert not meets_slo(voice(limit + 0.01))
    assert not meets_slo(voice(None))
    assert not meets_slo(voice(0.1, ok=False))
    assert meets_slo(voice(limit + 0.01), scale=2.0)


def test_a_chat_request_needs_both_ttft_and_itl() -> None:
    good = Outcome("chat", True, 0.5, 5.0, itls=(0.1,) * 40)
    slow_tail = Outcome("chat", True, 0.5, 5.0, itls=(0.1,) * 30 + (0.9,) * 10)
    assert meets_slo(good) and not meets_slo(slow_tail)


def test_a_document_is_judged_on_completion() -> None:
    total = CLASSES["document"].total_s
    assert total is not None
    assert meets_slo(Outcome("document", True, 30.0, total - 1))
    assert not meets_slo(Outcome("document", True, 1.0, total + 1))


def test_p95_is_the_nearest_rank() -> None:
    assert percentile([], 95) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0
    assert percentile([1.0, 2.0], 50) == 1.0


def test_summarize_counts_attainment_per_class_and_the_batch_held() -> None:
    outs = [voice(0.2), voice(9.0),
            Outcome("document", True, 1.0, 10.0, sent_s=0.0),
            Outcome("chat", True, 0.4, 10.0, itls=(0.1,), sent_s=0.0)]
    r = summarize_rate(1.0, outs)
    assert r.requests == 4 and r.attainment == 0.75
    assert r.by_class == {"voice": 0.5, "chat": 1.0, "document": 1.0}
    # 0.7 + 9.5 + 10 + 10 request-seconds over a 10 s span
    assert r.mean_in_flight == pytest.approx(30.2 / 10.0)
    assert r.ttft_p50_s == 0.4 and r.ttft_p95_s == 9.0


def rate(r: float, attainment: float, n: int = 10) -> RateResult:
    return RateResult(r, n, attainment, {}, 1.0, None, None, None)


def test_goodput_is_the_highest_rate_with_every_lower_one_at_ninety_percent() -> None:
    assert goodput([rate(0.1, 1.0), rate(0.2, 0.95), rate(0.4, 0.7), rate(0.8, 0.92)]) == 0.2
    assert goodput([rate(0.1, 0.5), rate(0.2, 1.0)]) is None
    assert goodput([rate(0.2, 0.9), rate(0.1, 1.0)]) == 0.2  # order does not matter
    assert goodput([rate(0.1, 1.0, n=0)]) is None


def test_goodput_ratio_says_when_it_is_only_a_bound() -> None:
    assert goodput_ratio(0.4, 0.2, 0.1) == (2.0, "")
    assert goodput_ratio(0.4, None, 0.1)[0] is None
    assert "only ours" in goodput_ratio(0.4, None, 0.1)[1]
    assert goodput_ratio(None, 0.2, 0.1)[0] == 0.0
