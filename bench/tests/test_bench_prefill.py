"""Pure parts of the prefill benchmark (no server): bandwidth and roofline, cold prefill
summaries and ratios, the multi-turn table, decode against the roofline, goals, report."""

from __future__ import annotations

from typing import Any

import pytest

from bench.client import RequestTiming
from bench.prefill import (
    best_bandwidth,
    build_parser,
    cold_ratios,
    cold_summary,
    conversation,
    decode_summary,
    errors_of,
    goals,
    measure_bandwidth,
    render,
    roofline_tokens_per_s,
    turn_rows,
)


def timing(chunks: list[float], prompt: int | None = None, cached: int | None = None,
           usage: int | None = None, error: str | None = None) -> RequestTiming:
    return RequestTiming(client=0, index=0, duration_s=chunks[-1] if chunks else 1.0,
                         chunk_times=chunks, usage_tokens=usage, prompt_tokens=prompt,
                         cached_tokens=cached, error=error)


def test_bandwidth_is_the_fastest_copy() -> None:
    assert best_bandwidth(1000, [2.0, 0.5, 1.0]) == 2000.0
    assert best_bandwidth(1000, []) is None


def test_measured_bandwidth_is_positive() -> None:
    result = measure_bandwidth(1, 2)
    assert result["bytes_per_s"] > 0
    assert len(result["times_s"]) == 2


def test_roofline_is_bandwidth_over_weight_bytes() -> None:
    # 135M fp32 parameters = 540 MB; 10.8 GB/s reads them 20 times a second.
    assert roofline_tokens_per_s(10.8e9, 540_000_000) == pytest.approx(20.0)
    assert roofline_tokens_per_s(None, 540_000_000) is None


def test_cold_summary_reads_prompt_tokens_per_second_at_ttft_p50() -> None:
    timings = [timing([0.5], prompt=520), timing([1.0], prompt=520), timing([2.0], prompt=520)]
    row = cold_summary(512, timings)
    assert row["ttft_p50_s"] == 1.0
    assert row["prompt_tokens"] == 520
    assert row["prompt_tokens_per_s"] == pytest.approx(520.0)
    assert row["ok"] == 3


def test_cold_summary_falls_back_to_the_target_length_and_skips_errors() -> None:
    row = cold_summary(256, [timing([0.5]), timing([], error="HTTP 500: boom")])
    assert row["prompt_tokens"] == 256
    assert row["prompt_tokens_per_s"] == pytest.approx(512.0)
    assert (row["ok"], row["requests"], row["first_error"]) == (1, 2, "HTTP 500: boom")


def test_cold_ratio_is_ours_over_mlx_lm_per_length() -> None:
    ours = [cold_summary(512, [timing([1.0], prompt=500)]),
            cold_summary(1024, [timing([2.0], prompt=1000)])]
    ref = [cold_summary(512, [timing([0.8], prompt=500)])]
    ratios = cold_ratios(ours, ref)
    assert [r["length"] for r in ratios] == [512]
    assert ratios[0]["prompt_tokens_per_s"] == pytest.approx(0.8)
    assert ratios[0]["ttft_p50"] == pytest.approx(1.25)


def test_conversation_alternates_and_ends_with_the_user() -> None:
    messages = conversation(["a", "b", "c"], ["x", "y", "z"])
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages] == ["a", "x", "b", "y", "c"]


def test_turn_rows_compare_the_last_turns_with_cold() -> None:
    warm = [timing([1.0], prompt=140), timing([0.2], prompt=280, cached=130),
            timing([0.3], prompt=420, cached=270)]
    rows = turn_rows(warm, {3: timing([1.5], prompt=421)})
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[1]["warm_over_cold"] is None
    assert rows[2]["warm_over_cold"] == pytest.approx(0.2)
    assert (rows[2]["cached_tokens"], rows[2]["cold_prompt_tokens"]) == (270, 421)


def test_decode_rate_and_roofline_share() -> None:
    # 5 tokens, first at 0.1 s and last at 0.5 s: 0.1 s a token, 10 tokens/s.
    d = decode_summary([timing([0.1, 0.2, 0.3, 0.4, 0.5], usage=5)], roofline=20.0)
    assert d["tokens_per_s"] == pytest.approx(10.0)
    assert d["roofline_share"] == pytest.approx(0.5)
    assert decode_summary([], roofline=20.0)["tokens_per_s"] is None


def servers_fixture() -> dict[str, Any]:
    turns_ours = turn_rows([timing([1.0], prompt=140), timing([0.25], prompt=280)],
                           {2: timing([1.0], prompt=281)})
    turns_ref = turn_rows([timing([1.0], prompt=140), timing([0.5], prompt=280)],
                          {2: timing([1.0], prompt=281)})
    return {
        "ours": {"command": "python -m appliance serve --model m", "log": "ours.log",
                 "error": None, "cold": [cold_summary(512, [timing([1.0], prompt=512)])],
                 "turns": turns_ours,
                 "decode": decode_summary([timing([0.1, 0.2, 0.3], usage=3)], 15.0)},
        "mlx_lm": {"command": "python -m mlx_lm server --model m", "log": "mlx_lm.log",
                   "error": None, "cold": [cold_summary(512, [timing([1.1], prompt=512)])],
                   "turns": turns_ref,
                   "decode": decode_summary([timing([0.1, 0.2, 0.3], usage=3)], 30.0)},
    }


def test_goals_judge_each_figure() -> None:
    servers = servers_fixture()
    ratios = cold_ratios(servers["ours"]["cold"], servers["mlx_lm"]["cold"])
    g = goals(servers, ratios)
    assert g["cold_prefill_ours_over_mlx_lm"]["met"] is True
    assert g["ours_multi_turn_over_cold"]["value"] == pytest.approx(0.25)
    assert g["ours_multi_turn_over_cold"]["met"] is True
    assert g["mlx_lm_multi_turn_over_cold"]["met"] is False
    assert g["ours_decode_roofline_share"]["met"] is True  # 10 tok/s of 15
    assert g["mlx_lm_decode_roofline_share"]["met"] is False  # 10 of 30


def test_goals_without_mlx_lm_are_not_measured() -> None:
    servers = {"ours": {"error": "did not start"}}
    g = goals(servers, [])
    assert g["cold_prefill_ours_over_mlx_lm"]["met"] is None
    assert g["ours_decode_roofline_share"]["met"] is None


def test_errors_of_collects_every_part() -> None:
    server = {"error": None, "cold": [{"first_error": "HTTP 400"}],
              "turns": [{"error": None}, {"error": "timeout"}], "decode": {"first_error": None}}
    assert errors_of(server) == ["HTTP 400", "timeout"]


def test_report_names_commands_and_no_machine_paths() -> None:
    servers = servers_fixture()
    ratios = cold_ratios(servers["ours"]["cold"], servers["mlx_lm"]["cold"])
    report = {
        "meta": {"date": "2026-12-01T00:00:00+00:00", "command": "python -m "
                 "bench.prefill --lengths 512", "model": {"path": "m",
                 "model_type": "llama", "parameter_bytes": 4_000_000},
                 "git_commit": "abc", "machine": "Linux x86_64, 2 CPUs", "blas": "openblas",
                 "max_batch_size": 8, "lengths": [512], "repeats": 1, "turns": 2,
                 "turn_tokens": 100, "answer_tokens": 32, "decode_tokens": 3},
        "bandwidth": {"method": "numpy copy", "bytes_per_s": 1e10},
        "roofline_tokens_per_s": 15.0, "servers": servers, "ratios": ratios,
        "goals": goals(servers, ratios)}
    text = render(report)
    assert "`python -m appliance serve --model m`" in text
    assert "`python -m mlx_lm server --model m`" in text
    assert "| 512 | ours/mlx_lm |" in text
    assert "10.00 GB/s" in text
    assert "/work" not in text and "/home" not in text


def test_default_lengths_fit_a_2048_token_context() -> None:
    args = build_parser().parse_args([])
    assert max(args.lengths) + 64 <= 2048
    assert args.turns * (args.turn_tokens + args.answer_tokens) >= 900

