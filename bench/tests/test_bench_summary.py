"""The one writer of benchmark summaries and traces (bench/summary.py, issue 53 item 7)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench import (
    dashboards,
    goodput,
    jobs_fairness,
    matmul,
    mixed,
    quant_act,
    serve,
    summary,
    voice,
)
from bench.fairness_config import build_parser as fairness_parser


def report_with_requests(n: int) -> dict[str, object]:
    return {"meta": {"command": "python -m bench.serve", "git_commit": "abc"},
            "servers": {"ours": {"levels": [{"concurrency": 1, "tokens_per_s": 12.345678}],
                                 "requests": [{"ttft_s": 0.1 * i} for i in range(n)]}},
            "ratios": [{"concurrency": 1, "tokens_per_s": 1.0 / 3.0}]}


def test_a_summary_drops_every_request_and_keeps_the_figures() -> None:
    got = summary.summarize(report_with_requests(5000))
    assert "requests" not in got["servers"]["ours"]
    assert got["servers"]["ours"]["levels"][0]["tokens_per_s"] == 12.35
    assert got["ratios"][0]["tokens_per_s"] == 0.3333
    assert len(summary.summary_text(got).encode()) <= summary.SUMMARY_LIMIT


def test_a_summary_names_the_commit_machine_and_command_when_the_report_does_not() -> None:
    facts = {"git_commit": "f00", "machine": "x86_64 Linux, 2 cores", "command": "c"}
    got = summary.summarize({"figures": {"p50": 1.0}}, facts)
    assert got["meta"] == facts
    kept = summary.summarize(report_with_requests(1), facts)["meta"]
    assert kept["git_commit"] == "abc" and kept["machine"] == facts["machine"]


def test_a_summary_over_the_limit_is_refused_with_the_culprit() -> None:
    bulky = {"meta": {}, "latencies": [0.1 * i for i in range(5000)]}
    with pytest.raises(summary.SummaryTooLarge, match="latencies"):
        summary.summary_text(summary.summarize(bulky))


def test_keep_writes_the_trace_whole_and_the_summary_small(tmp_path: Path) -> None:
    report = report_with_requests(5000)
    trace = summary.keep("serve", report, tmp_path / "results" / "s.json",
                         tmp_path / "t.json.gz")
    raw = json.loads(gzip.decompress(trace.read_bytes()))
    assert len(raw["servers"]["ours"]["requests"]) == 5000
    assert raw["run"]["git_commit"]
    small = (tmp_path / "results" / "s.json").read_bytes()
    assert len(small) <= summary.SUMMARY_LIMIT and b"requests" not in small


def test_the_default_trace_goes_to_the_run_folder_or_the_cache(tmp_path: Path) -> None:
    in_run = summary.keep("serve", {"x": 1.0}, None, None, tmp_path)
    assert in_run == tmp_path / "trace.json.gz"
    assert summary.default_trace_path("serve").parent == summary.DEFAULT_TRACE_ROOT
    repo = Path(summary.__file__).resolve().parent.parent
    assert repo not in summary.DEFAULT_TRACE_ROOT.resolve().parents


@pytest.mark.parametrize("parser", [
    serve.build_parser(), fairness_parser(), goodput.build_parser()])
def test_the_harnesses_take_summary_and_trace_and_no_longer_json(parser: object) -> None:
    import argparse
    assert isinstance(parser, argparse.ArgumentParser)
    args = parser.parse_args(["--summary", "s.json", "--trace", "t.json"])
    assert args.summary == Path("s.json") and args.trace == Path("t.json")
    with pytest.raises(SystemExit):
        parser.parse_args(["--json", "x.json"])


def test_jobs_and_dashboards_keep_through_the_shared_writer() -> None:
    for module in (jobs_fairness, dashboards, quant_act, voice, matmul, mixed):
        assert "summary.keep(" in Path(module.__file__ or "").read_text()


def test_the_reduction_rewrites_a_raw_report_in_place_once(tmp_path: Path) -> None:
    from bench import reduce_results
    raw = tmp_path / "serve-x.json"
    raw.write_text(json.dumps(report_with_requests(5000), indent=2))
    assert reduce_results.reduce_file(raw, "abc123")
    got = json.loads(raw.read_text())
    assert got["meta"]["trace"] == "git show abc123:bench/results/serve-x.json"
    assert got["servers"]["ours"]["levels"][0]["concurrency"] == 1
    assert not reduce_results.reduce_file(raw, "abc123")
