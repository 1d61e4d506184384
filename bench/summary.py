"""What a benchmark run keeps: a small summary for git, its raw trace outside the tree.

Every harness takes ``--summary PATH`` (commit, machine, command, medians, ratios; at most
:data:`SUMMARY_LIMIT` bytes, for ``bench/results/``) and ``--trace PATH`` (every request's
timings; by default under :data:`DEFAULT_TRACE_ROOT`, never in the repository), and writes
both through :func:`keep`, so that no run adds megabytes to every clone (issue 53).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.report import display_command, git_commit

# A summary is read in a diff and kept in every clone: 10 KB holds a run's figures.
SUMMARY_LIMIT = 10 * 1024
# Raw per-request records: the trace keeps them, the summary drops them.
RAW_KEYS = frozenset({"requests", "phases", "records", "starts", "samples", "timeline",
                      "events", "per_request", "raw"})
# Four significant digits are finer than any run-to-run noise we measure.
DIGITS = 4
REPO = Path(__file__).resolve().parent.parent


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


DEFAULT_TRACE_ROOT = _cache_home() / "appliance-bench" / "traces"


class SummaryTooLarge(ValueError):
    """A summary over :data:`SUMMARY_LIMIT`: a raw list slipped past :data:`RAW_KEYS`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The two output flags every harness shares."""
    parser.add_argument("--summary", type=Path, default=None,
                        help="write the run's small summary (commit, machine, command, "
                             "medians, ratios; <= 10 KB) here, e.g. bench/results/NAME.json")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write the raw trace (every request) here; default "
                             f"{DEFAULT_TRACE_ROOT}/<bench>-<time>.json.gz")


def _round(value: float) -> float:
    if value == 0 or value != value or value in (float("inf"), float("-inf")):
        return value
    return float(f"{value:.{DIGITS}g}")


def reduce(value: Any, raw_keys: frozenset[str] = RAW_KEYS) -> Any:
    """The report without its raw lists, floats to :data:`DIGITS` significant digits."""
    if isinstance(value, Mapping):
        return {str(k): reduce(v, raw_keys) for k, v in value.items() if k not in raw_keys}
    if isinstance(value, (list, tuple)):
        return [reduce(v, raw_keys) for v in value]
    if isinstance(value, float):
        return _round(value)
    return value


def run_facts(argv: Sequence[str] | None = None) -> dict[str, str]:
    """Commit, machine, command and time of this run."""
    return {
        "git_commit": git_commit(REPO),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "command": display_command(["python", "-m", _module(), *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _module() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


def summarize(report: Mapping[str, Any], facts: Mapping[str, str] | None = None
              ) -> dict[str, Any]:
    """The summary of a report: its figures, and the run's facts where the report's own
    ``meta`` lacks them."""
    summary = reduce(report)
    meta = summary.get("meta")
    if not isinstance(meta, dict):
        meta = {}
        summary = {"meta": meta, **summary}
    for key, value in (facts or {}).items():
        meta.setdefault(key, value)
    return summary


def summary_text(summary: Mapping[str, Any]) -> str:
    """The summary as it is kept: one key a line at the top, within the limit."""
    text = json.dumps(summary, indent=1, separators=(",", ":")) + "\n"
    if len(text.encode()) > SUMMARY_LIMIT:
        text = json.dumps(summary, separators=(",", ":")) + "\n"
    size = len(text.encode())
    if size > SUMMARY_LIMIT:
        biggest = sorted(summary, key=lambda k: -len(json.dumps(summary[k])))[:3]
        raise SummaryTooLarge(f"summary is {size} bytes (limit {SUMMARY_LIMIT}); "
                              f"largest keys: {', '.join(biggest)}")
    return text


def write_summary(path: Path, report: Mapping[str, Any],
                  facts: Mapping[str, str] | None = None) -> Path:
    """Write the summary of ``report`` at ``path``."""
    text = summary_text(summarize(report, facts))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def default_trace_path(bench: str, now: dt.datetime | None = None) -> Path:
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    return DEFAULT_TRACE_ROOT / f"{bench}-{stamp}.json.gz"


def write_trace(path: Path, report: Mapping[str, Any]) -> Path:
    """Write the whole report at ``path`` (gzip-compressed when it ends in ``.gz``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(report, separators=(",", ":")).encode() + b"\n"
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def keep(bench: str, report: Mapping[str, Any], summary: Path | None, trace: Path | None,
         run_dir: Path | None = None) -> Path:
    """What every harness calls at its end: the trace always (at ``trace``, else in the
    run's own git-ignored folder, else under :data:`DEFAULT_TRACE_ROOT`), the summary when
    asked for. Returns the trace's path."""
    facts = run_facts()
    default = run_dir / "trace.json.gz" if run_dir is not None else default_trace_path(bench)
    trace_path = write_trace(trace or default, {"run": facts, **report})
    print(f"[bench] trace: {trace_path}", file=sys.stderr)
    if summary is not None:
        write_summary(summary, report, facts)
        print(f"[bench] summary: {summary}", file=sys.stderr)
    return trace_path


def write_report(output_dir: Path, markdown: str, report: Mapping[str, Any], bench: str,
                 args: argparse.Namespace) -> None:
    """Print the Markdown and keep it in the run's folder; the trace and the summary as
    :func:`keep` (``args.summary``, ``args.trace``)."""
    print(markdown)
    (output_dir / "report.md").write_text(markdown + "\n")
    keep(bench, report, args.summary, args.trace, output_dir)
