"""Fairness while a background job map-reduces a long document.

``python -m bench.jobs_fairness [--requests N] [--doc-tokens T]``: the daemon
(assembled as ``appliance serve`` does, on a loopback port, demo model) first measures the
time to first token of a voice user and of an interactive user alone (``N`` streamed
requests each, taking turns), then starts another user's job that summarises a document of
``T`` tokens map-reduce (many ``background`` requests) and samples both users, taking
turns, for **the whole job**: from its start until it ends. It reports per class the p50
and p95 alone and during the job, their ratio, how many requests each sample holds, what
share of the job's stages ran while sampling, and whether the job finished (no starvation).

End-of-sequence is suppressed (``logit_bias``) so every answer streams text: a sample that
ends before its first text is a failure and is counted and reported as one, never dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.percentiles import percentile
from appliance.vocab import Klass
from bench import summary
from bench.client import chunk_text
from bench.provision import BenchUser, add_users

CORPUS = Path(__file__).resolve().parents[1] / "appliance" / "demo" / "corpus.txt"
"""The demo model's training text: a long document of the demo model's own words."""

QUESTIONS = ("Turn on the kitchen lights.", "What is the weather like?",
             "Set a timer for ten minutes.", "Is the front door locked?")


@dataclass
class Sample:
    """TTFTs (ms) of one user, and the requests that ended without any text."""

    ttft_ms: list[float] = field(default_factory=list)
    empty: int = 0
    refused: list[str] = field(default_factory=list)
    """Requests the server refused: status and error message, as the client got them."""

    def figures(self) -> dict[str, Any]:
        """Median and p95 TTFT, the count and the empty answers (the summary's part)."""
        ms = self.ttft_ms
        return {"n": len(ms), "empty": self.empty,
                "ttft_p50_ms": statistics.median(ms) if ms else None,
                "ttft_p95_ms": p95(ms) if ms else None}

    def line(self) -> str:
        if not self.ttft_ms:
            return f"n=0, empty {self.empty}, refused {len(self.refused)}"
        return (f"p50 {statistics.median(self.ttft_ms):.0f} ms, p95 {p95(self.ttft_ms):.0f} ms"
                f" (n={len(self.ttft_ms)}, empty {self.empty}, refused {len(self.refused)})")


def p95(values: list[float]) -> float:
    return percentile(values, 95, "linear") or 0.0


def ask(client: httpx.Client, n: int, no_eos: dict[str, float], sample: Sample) -> None:
    """One streamed chat request; its TTFT goes into ``sample`` (or it counts as empty)."""
    started = time.perf_counter()
    body = {"messages": [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}],
            "max_tokens": 8, "stream": True, "logit_bias": no_eos}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:  # a failure of the sample, reported with the server's words
            sample.refused.append(f"{r.status_code}: {r.read().decode()[:200]}")
            return
        for line in r.iter_lines():
            # the first chunk carrying text: the role chunk before it has an empty content
            if line.startswith("data: {") and chunk_text(json.loads(line[6:])):
                sample.ttft_ms.append((time.perf_counter() - started) * 1000)
                return
    sample.empty += 1


def main(argv: list[str] | None = None) -> int:
    from appliance.daemon import build_daemon, serve_in_thread
    from appliance.settings import Settings

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=30,
                    help="solo requests per user (default 30)")
    ap.add_argument("--doc-tokens", type=int, default=12_000)
    summary.add_arguments(ap)
    args = ap.parse_args(argv)
    settings = Settings()
    settings.store.data_dir = tempfile.mkdtemp(prefix="appliance-bench-")
    # the daemon as `appliance serve` assembles it (appliance.daemon), served on a thread
    daemon = build_daemon(settings, secret="x" * 32, drain_timeout=5)
    who = add_users(daemon.store, [BenchUser("light", key_name="k"),
                                   BenchUser("voice", max_class=Klass.VOICE, key_name="k"),
                                   BenchUser("heavy", key_name="k")])
    served = serve_in_thread(daemon)
    tok = daemon.services.model.tokenizer
    loaded = daemon.engine.loaded
    assert loaded is not None
    no_eos = {str(t): -100.0 for t in loaded.eos_token_ids}
    ids = tok.encode(CORPUS.read_text())
    while len(ids) < args.doc_tokens:
        ids = ids + ids
    doc = tok.decode(ids[:args.doc_tokens])

    def client(name: str) -> httpx.Client:
        return httpx.Client(base_url=served.url, timeout=600,
                            headers={"Authorization": f"Bearer {who[name]}"})

    solo = {"interactive": Sample(), "voice": Sample()}
    busy = {"interactive": Sample(), "voice": Sample()}
    try:
        with client("light") as lc, client("voice") as vc, client("heavy") as hc:
            turns = (("interactive", lc), ("voice", vc))
            for _, c in turns:  # warm-up
                ask(c, 0, no_eos, Sample())
            for i in range(args.requests):
                for klass, c in turns:
                    ask(c, i, no_eos, solo[klass])
            job = hc.post("/jobs", json={"name": "long", "source": "text", "text": doc,
                                         "max_output_tokens": 32}).json()
            run = hc.post(f"/jobs/{job['id']}/run").json()
            run_url = f"/jobs/{job['id']}/runs/{run['id']}"
            started = time.perf_counter()
            i = 0
            while (got := hc.get(run_url).json())["status"] in ("pending", "running"):
                for klass, c in turns:
                    ask(c, i, no_eos, busy[klass])
                i += 1
            job_s = time.perf_counter() - started
    finally:
        served.stop()
    report: dict[str, Any] = {"doc_tokens": args.doc_tokens, "job_status": got["status"],
                              "job_progress": got["progress"], "job_requests": got["requests"],
                              "job_seconds": round(job_s, 1), "classes": {}}
    print(f"document {args.doc_tokens} tokens; the job ran {job_s:.0f} s and ended "
          f"'{got['status']}' ({got['requests']} requests, progress {got['progress']}); "
          "both users were sampled, taking turns, from its start to its end")
    for klass in ("voice", "interactive"):
        a, b = solo[klass], busy[klass]
        ratio = p95(b.ttft_ms) / p95(a.ttft_ms) if a.ttft_ms and b.ttft_ms else None
        print(f"{klass}: alone {a.line()}; during the job {b.line()}; p95 ratio "
              f"{'-' if ratio is None else f'{ratio:.2f}'}")
        for refusal in sorted(set(a.refused + b.refused)):
            print(f"  {klass} refused: {refusal}")
        report["classes"][klass] = {
            "solo": a.figures(), "busy": b.figures(), "refused": a.refused + b.refused,
            "p95_ratio": ratio, "samples": {"solo_ms": a.ttft_ms, "busy_ms": b.ttft_ms}}
    summary.keep("jobs_fairness", report, args.summary, args.trace)
    return 0 if got["status"] == "done" else 1


if __name__ == "__main__":
    raise SystemExit(main())
