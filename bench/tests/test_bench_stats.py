"""Pure parts of the serving benchmark: percentiles, aggregation, ratios, the table."""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.percentiles import percentile
from bench.chat_load import QUESTIONS, Workload, level_serials, prompt_for
from bench.client import (
    RequestTiming,
    chunk_text,
    sse_data,
    stream_chat,
    usage_completion_tokens,
)
from bench.process import resident
from bench.provision import last_line
from bench.report import describe_model, safe_ratio
from bench.serve import (
    Config,
    LevelRun,
    combine_flags,
    needs_provisioning,
    pool_runs,
    round_order,
    server_result,
    stagger_comparison,
)
from bench.serve_stats import (
    LevelRatio,
    LevelStats,
    compute_ratios,
    render_report,
    render_table,
    summarize_level,
    time_per_output_token,
    token_source,
)


def timing(
    chunks: list[float], usage: int | None = None, error: str | None = None
) -> RequestTiming:
    duration = chunks[-1] if chunks else 1.0
    return RequestTiming(
        client=0, index=0, duration_s=duration, chunk_times=chunks, usage_tokens=usage, error=error
    )


# ---- percentiles ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 50, 5.0),
        ([5.0], 95, 5.0),
        ([1.0, 2.0], 50, 1.5),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 50, 3.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 100, 5.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 95, 4.8),
        (list(range(1, 101)), 95, 95.05),
    ],
)
def test_percentile_matches_linear_interpolation(
    values: list[float], q: float, expected: float
) -> None:
    result = percentile(values, q, "linear")
    assert result is not None
    assert math.isclose(result, expected, rel_tol=1e-12)


def test_percentile_ignores_input_order() -> None:
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], 50) == 3.0


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_rejects_out_of_range(q: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0], q)


def test_safe_ratio() -> None:
    assert safe_ratio(3.0, 2.0) == 1.5
    assert safe_ratio(None, 2.0) is None
    assert safe_ratio(1.0, None) is None
    assert safe_ratio(1.0, 0.0) is None


# ---- one request ----------------------------------------------------------------------


def test_request_timing_derived_figures() -> None:
    t = timing([0.5, 0.6, 0.8, 1.1])
    assert t.ttft_s == 0.5
    assert t.inter_token_latencies == pytest.approx([0.1, 0.2, 0.3])
    assert t.output_tokens == 4  # counted from chunks
    assert timing([0.5, 0.6], usage=7).output_tokens == 7  # server usage wins
    empty = timing([])
    assert empty.ttft_s is None
    assert empty.inter_token_latencies == []


def test_time_per_output_token_uses_token_count() -> None:
    # 3 chunks spanning 1.0 s but the server says 5 tokens (some chunks held 2 tokens)
    assert time_per_output_token(timing([1.0, 1.5, 2.0], usage=5)) == pytest.approx(0.25)
    assert time_per_output_token(timing([1.0])) is None


def test_sse_parsing_helpers() -> None:
    assert sse_data('data: {"a": 1}') == '{"a": 1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(": keepalive 10/40") is None
    assert sse_data("event: message") is None
    assert sse_data("") is None
    chunk: dict[str, Any] = {"choices": [{"delta": {"content": "Hi", "role": "assistant"}}]}
    assert chunk_text(chunk) == "Hi"
    assert chunk_text({"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}) == ""
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "hmm"}}]}) == "hmm"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert usage_completion_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == 3
    assert usage_completion_tokens({"choices": [], "usage": None}) is None
    assert usage_completion_tokens(chunk) is None


# ---- aggregation ----------------------------------------------------------------------


def test_summarize_level_aggregates_all_clients() -> None:
    timings = [
        timing([0.1, 0.2, 0.3], usage=3),
        timing([0.3, 0.5, 0.7, 0.9], usage=4),
    ]
    stats = summarize_level(2, timings, wall_s=1.4)
    assert stats.concurrency == 2
    assert stats.requests == 2
    assert stats.errors == 0
    assert stats.output_tokens == 7
    assert stats.tokens_per_s == pytest.approx(5.0)
    assert stats.ttft_p50_s == pytest.approx(0.2)
    assert stats.ttft_p95_s == pytest.approx(0.1 + 0.95 * 0.2)
    # gaps: 0.1, 0.1, 0.2, 0.2, 0.2 → median 0.2
    assert stats.itl_p50_s == pytest.approx(0.2)
    assert stats.itl_p95_s == pytest.approx(0.2)
    assert stats.itl_max_s == pytest.approx(0.2)
    assert stats.token_source == "usage"
    assert stats.first_error is None


def test_summarize_level_counts_errors_but_excludes_them_from_figures() -> None:
    timings = [timing([0.1, 0.3]), timing([], error="HTTP 401: unauthorized")]
    stats = summarize_level(2, timings, wall_s=2.0)
    assert stats.requests == 2
    assert stats.errors == 1
    assert stats.output_tokens == 2
    assert stats.tokens_per_s == pytest.approx(1.0)
    assert stats.ttft_p50_s == pytest.approx(0.1)
    assert stats.token_source == "chunks"
    assert stats.first_error == "HTTP 401: unauthorized"


def test_summarize_level_all_failed() -> None:
    stats = summarize_level(1, [timing([], error="boom")], wall_s=1.0)
    assert stats.tokens_per_s is None
    assert stats.ttft_p95_s is None
    assert stats.itl_p95_s is None
    assert stats.token_source == "none"


def test_token_source_mixed() -> None:
    assert token_source([timing([0.1], usage=1), timing([0.1])]) == "mixed"


def test_pool_runs_merges_rounds_per_level() -> None:
    runs = [
        LevelRun(1, 2.0, [timing([0.1, 0.2], usage=2)]),
        LevelRun(2, 4.0, [timing([0.3, 0.4], usage=2), timing([0.5, 0.6], usage=2)]),
        LevelRun(1, 6.0, [timing([0.3, 0.4], usage=6)]),
    ]
    pooled = pool_runs(runs)
    assert [s.concurrency for s in pooled] == [1, 2]
    one = pooled[0]
    assert one.requests == 2
    assert one.output_tokens == 8
    assert one.wall_s == pytest.approx(8.0)
    assert one.tokens_per_s == pytest.approx(1.0)  # 8 tokens over 2 s + 6 s
    assert one.ttft_p50_s == pytest.approx(0.2)
    assert pooled[1].tokens_per_s == pytest.approx(1.0)


def test_round_order_alternates() -> None:
    assert round_order(["ours", "mlx_lm"], 0) == ["ours", "mlx_lm"]
    assert round_order(["ours", "mlx_lm"], 1) == ["mlx_lm", "ours"]
    assert round_order(["ours", "mlx_lm"], 2) == ["ours", "mlx_lm"]


def test_combine_flags() -> None:
    assert combine_flags([True, True]) is True
    assert combine_flags([True, False]) is False
    assert combine_flags([True, None]) is None
    assert combine_flags([]) is None


# ---- ratios and the table -------------------------------------------------------------


def level(c: int, tps: float | None, ttft95: float | None, itl95: float | None) -> LevelStats:
    return LevelStats(
        concurrency=c,
        requests=c,
        errors=0,
        output_tokens=64 * c,
        wall_s=10.0,
        tokens_per_s=tps,
        ttft_p50_s=ttft95,
        ttft_p95_s=ttft95,
        itl_p50_s=itl95,
        itl_p95_s=itl95,
        tpot_mean_s=itl95,
        token_source="usage",
    )


def test_compute_ratios_pairs_levels_and_divides_ours_by_reference() -> None:
    ours = [level(1, 12.0, 0.5, 0.08), level(8, 60.0, 2.0, 0.2), level(16, 70.0, 3.0, 0.3)]
    ref = [level(1, 10.0, 0.25, 0.1), level(8, 30.0, 4.0, 0.2)]
    ratios = compute_ratios(ours, ref)
    assert [r.concurrency for r in ratios] == [1, 8]  # 16 has no reference
    assert ratios[0].tokens_per_s == pytest.approx(1.2)
    assert ratios[0].ttft_p95 == pytest.approx(2.0)
    assert ratios[0].itl_p95 == pytest.approx(0.8)
    assert ratios[1].tokens_per_s == pytest.approx(2.0)
    assert ratios[1].ttft_p95 == pytest.approx(0.5)
    assert ratios[1].itl_p95 == pytest.approx(1.0)


def test_compute_ratios_missing_figures_give_none() -> None:
    ratios = compute_ratios([level(1, None, 0.5, 0.1)], [level(1, 10.0, None, 0.0)])
    assert ratios == [LevelRatio(concurrency=1, tokens_per_s=None, ttft_p95=None, itl_p95=None)]


def test_render_table_rows_and_ratios() -> None:
    results = {"ours": [level(1, 12.0, 0.5, 0.08)], "mlx_lm": [level(1, 10.0, 0.25, 0.1)]}
    ratios = compute_ratios(results["ours"], results["mlx_lm"])
    lines = render_table(results, ratios).splitlines()
    assert lines[0].startswith("| C | server |")
    assert len(lines) == 2 + 3
    assert lines[2] == "| 1 | ours | 1/1 | 64 | 12.0 | 500 | 500 | 80 | 80 | – |"
    assert lines[3] == "| 1 | mlx_lm | 1/1 | 64 | 10.0 | 250 | 250 | 100 | 100 | – |"
    assert lines[4] == "| 1 | ours/mlx_lm |  |  | **1.20×** |  | **2.00×** |  | **0.80×** |  |"


def test_render_table_single_server_has_no_ratio_rows() -> None:
    table = render_table({"mlx_lm": [level(1, 10.0, 0.2, 0.1), level(2, 15.0, 0.3, 0.1)]}, [])
    assert "ours/mlx_lm" not in table
    assert len(table.splitlines()) == 4


def test_render_report_mentions_run_facts() -> None:
    ours, ref = [level(1, 12.0, 0.5, 0.08)], [level(1, 10.0, 0.25, 0.1)]
    report = {
        "meta": {
            "date": "2025-01-01T00:00:00+00:00",
            "command": "python -m bench.serve -n 1",
            "model": {"path": "/m", "model_type": "llama", "num_hidden_layers": 30},
            "blas_report": "OpenBLAS via LD_PRELOAD",
            "git_commit": "abc123",
            "versions": {"python": "3.11", "mlx": "0.1", "mlx_lm": "0.2"},
            "machine": "Linux x86_64, 2 CPUs",
            "requests_per_client": 1,
            "max_tokens": 64,
            "max_batch_size": 8,
        },
        "servers": {
            "ours": {"levels": [asdict(s) for s in ours], "command": "x", "log": "o.log"},
            "mlx_lm": {"levels": [asdict(s) for s in ref], "command": "y", "log": "m.log"},
        },
        "ratios": [asdict(r) for r in compute_ratios(ours, ref)],
    }
    text = render_report(report)
    for needle in (
        "python -m bench.serve -n 1",
        "abc123",
        "OpenBLAS",
        "llama, layers 30",
        "**1.20×**",
    ):
        assert needle in text


def test_describe_model() -> None:
    facts = {
        "model_type": "llama",
        "hidden_size": 576,
        "parameters": 134_515_008,
        "dtypes": ["BF16"],
    }
    assert describe_model(facts) == "llama, hidden 576, 134.5M params, BF16"


# ---- workload -------------------------------------------------------------------------


def test_prompts_are_distinct_across_a_run() -> None:
    serials: list[int] = []
    offset = 0
    for c in (1, 2, 4, 8):
        per_level = level_serials(offset, c, 3)
        assert len(per_level) == c
        assert all(len(client) == 3 for client in per_level)
        serials += [s for client in per_level for s in client]
        offset += c * 3
    assert len(set(serials)) == len(serials) == 45
    assert len({prompt_for(s) for s in serials}) == 45
    quoted = {prompt_for(s, quote=True) for s in serials}
    assert len(quoted) == 45
    assert all("word for word" in q and QUESTIONS[0] in prompt_for(0, quote=True)
               for q in quoted)


# ---- the streaming client against an in-process transport (no server) -----------------


def sse_body(*events: str) -> bytes:
    return "".join(f"{event}\n\n" for event in events).encode()


def run_stream(handler: Callable[[httpx.Request], httpx.Response]) -> RequestTiming:
    async def go() -> RequestTiming:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_chat(
                client, "http://test/v1/chat/completions", {"stream": True}, {}, client_id=3
            )

    return asyncio.run(go())


def test_stream_chat_times_text_chunks_and_reads_usage() -> None:
    def chunk(text: str, finish: str | None = None) -> str:
        delta = {"content": text}
        return "data: " + json.dumps({"choices": [{"delta": delta, "finish_reason": finish}]})

    usage = {
        "completion_tokens": 4,
        "prompt_tokens": 40,
        "prompt_tokens_details": {"cached_tokens": 5},
    }
    body = sse_body(
        ": keepalive 10/40",
        chunk("Hel"),
        chunk("lo"),
        chunk(" there"),
        chunk("", "length"),
        "data: " + json.dumps({"choices": [], "usage": usage}),
        "data: [DONE]",
    )
    t = run_stream(lambda request: httpx.Response(200, content=body))
    assert t.ok
    assert t.client == 3
    assert len(t.chunk_times) == 3  # the empty final chunk is not a token
    assert t.chunk_times == sorted(t.chunk_times)
    assert t.output_tokens == 4
    assert (t.prompt_tokens, t.cached_tokens) == (40, 5)


def test_stream_chat_records_http_errors() -> None:
    t = run_stream(lambda request: httpx.Response(401, json={"error": {"message": "no key"}}))
    assert not t.ok
    assert t.error is not None and t.error.startswith("HTTP 401")
    assert t.chunk_times == []


def test_stream_chat_records_stream_errors() -> None:
    body = sse_body('data: {"error": {"message": "inference backend error"}}')
    t = run_stream(lambda request: httpx.Response(200, content=body))
    assert t.error is not None and "inference backend error" in t.error


# ---- provisioning decisions ------------------------------------------------------------


def config(**overrides: Any) -> Config:
    values: dict[str, Any] = {
        "model_dir": Path("/m"),
        "servers": ["ours", "mlx_lm"],
        "workload": Workload([1], 1, 8, True, False, 10.0),
        "max_batch_size": 8,
        "blas": "bundled",
        "api_key": None,
        "our_cmd": ["python", "-m", "appliance", "serve"],
        "our_env": {},
        "mlx_cmd": ["python", "-m", "mlx_lm", "server"],
        "output_dir": Path("/tmp/out"),
        "ready_timeout_s": 1.0,
        "command": "x",
    }
    values.update(overrides)
    return Config(**values)


def test_needs_provisioning_only_without_key_or_data_dir() -> None:
    assert needs_provisioning(config())
    assert not needs_provisioning(config(api_key="k"))
    assert not needs_provisioning(config(our_env={"APPLIANCE_DATA_DIR": "/d"}))
    assert not needs_provisioning(config(servers=["mlx_lm"]))


def test_last_line_reads_the_key_printed_last() -> None:
    out = "key cdf39f98 for bench (class interactive); shown once:\napl_cdf_xyz\n\n"
    assert last_line(out) == "apl_cdf_xyz"
    assert last_line("") == ""


# ---- staggered arrivals ---------------------------------------------------------------


def test_stagger_comparison_sets_staggered_itl_against_steady() -> None:
    steady = LevelRun(2, 1.0, [timing([0.1, 0.2, 0.3], usage=3)])  # gaps 100 ms
    staggered = LevelRun(2, 1.2, [timing([0.1, 0.25, 0.4], usage=3)], staggered=True)
    assert [s.concurrency for s in pool_runs([steady, staggered])] == [2]
    assert pool_runs([steady, staggered])[0].itl_p95_s == pytest.approx(0.1)
    rows = stagger_comparison([steady, staggered])
    assert len(rows) == 1
    assert rows[0]["itl_p95_staggered_s"] == pytest.approx(0.15)
    assert rows[0]["ratio"] == pytest.approx(1.5)
    assert stagger_comparison([steady]) == []


def test_resident_reads_a_live_process_and_nothing_for_none() -> None:
    memory = resident(os.getpid())
    assert memory is not None and 0 < memory["rss"] <= memory["peak"]
    assert resident(None) is None
    assert resident(2**22 + 12345) is None  # above Linux's largest PID: no such process


def test_resident_memory_is_kept_per_server_and_set_against_ours() -> None:
    starts: list[dict[str, Any]] = [
        {"command": "x", "log": "a.log", "error": None, "memory": {"rss": 2 * 10**9,
                                                                   "peak": 3 * 10**9}},
              {"command": "x", "log": "b.log", "error": None, "memory": None},
              {"command": "x", "log": "c.log", "error": None,
               "memory": {"rss": 10**9, "peak": 4 * 10**9}}]
    ours = server_result(starts, [])
    assert (ours["resident_bytes"], ours["resident_peak_bytes"]) == (2 * 10**9, 4 * 10**9)
    peer = server_result([{"command": "y", "log": "p.log", "error": None,
                           "memory": {"rss": 16 * 10**8, "peak": 16 * 10**8}}], [])
    unread = server_result([{"command": "z", "log": "m.log", "error": None}], [])
    assert unread["resident_bytes"] is None
    report = {"meta": {"date": "2025-01-01T00:00:00+00:00", "command": "c",
                       "model": {"path": "/m"}, "blas_report": "b", "git_commit": "abc",
                       "versions": {"python": "3.11"}, "machine": "m",
                       "requests_per_client": 1, "max_tokens": 8, "max_batch_size": 1},
              "servers": {"ours": ours, "llama_cpp": peer, "mlx_lm": unread}, "ratios": []}
    text = render_report(report)
    assert "resident after the levels 2.00 GB (peak 4.00 GB)" in text
    assert "resident memory ours/llama_cpp: **1.25×**" in text
    assert "ours/mlx_lm" not in text
