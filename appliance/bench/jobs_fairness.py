"""Fairness while a background job map-reduces a long document.

``python -m appliance.bench.jobs_fairness [--requests N] [--doc-tokens T]``: the daemon
(assembled as ``appliance serve`` does, on a loopback port, demo model) measures an
interactive user's time to first token alone, then again while another user's job
summarises a document of ``T`` tokens map-reduce (many ``background`` requests); it reports
both p95 values, their ratio, and whether the job finished (no starvation).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx


def _ttft(client: httpx.Client) -> float | None:
    started = time.perf_counter()
    body = {"messages": [{"role": "user", "content": "Turn on the kitchen lights."}],
            "max_tokens": 8, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return (time.perf_counter() - started) * 1000
    return None  # an answer that ended before any text (counted as missing)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[18] if len(values) >= 2 else values[0]


def main(argv: list[str] | None = None) -> int:
    from appliance.daemon import build_daemon, serve_in_thread
    from appliance.settings import Settings
    from appliance.store import keys, users

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--doc-tokens", type=int, default=30_000)
    args = ap.parse_args(argv)
    settings = Settings()
    settings.store.data_dir = tempfile.mkdtemp(prefix="appliance-bench-")
    # the daemon as `appliance serve` assembles it (appliance.daemon), served on a thread
    served = serve_in_thread(build_daemon(settings, secret="x" * 32))
    with served.daemon.store.sessions.begin() as s:
        light = users.create_user(s, "light", "password-light")
        heavy = users.create_user(s, "heavy", "password-heavy")
        _, light_key = keys.create_api_key(s, light, "k")
        _, heavy_key = keys.create_api_key(s, heavy, "k")
    url = served.url
    corpus = (Path(__file__).resolve().parents[1] / "demo" / "corpus.txt").read_text()
    tok = served.daemon.services.model.tokenizer
    ids = tok.encode(corpus)
    while len(ids) < args.doc_tokens:
        ids = ids + ids
    doc = tok.decode(ids[:args.doc_tokens])
    try:
        with httpx.Client(base_url=url, timeout=600,
                          headers={"Authorization": f"Bearer {light_key}"}) as lc, \
                httpx.Client(base_url=url, timeout=600,
                             headers={"Authorization": f"Bearer {heavy_key}"}) as hc:
            _ttft(lc)  # warm-up
            solo = [t for t in (_ttft(lc) for _ in range(args.requests)) if t is not None]
            job = hc.post("/jobs", json={"name": "long", "source": "text", "text": doc,
                                         "max_output_tokens": 32}).json()
            run = hc.post(f"/jobs/{job['id']}/run").json()
            while hc.get(f"/jobs/{job['id']}/runs/{run['id']}").json()["progress"]["done"] < 1:
                time.sleep(0.05)
            busy = [t for t in (_ttft(lc) for _ in range(args.requests)) if t is not None]
            progress_at_end = hc.get(f"/jobs/{job['id']}/runs/{run['id']}").json()["progress"]
            job_started = time.perf_counter()
            while True:
                got = hc.get(f"/jobs/{job['id']}/runs/{run['id']}").json()
                if got["status"] not in ("pending", "running"):
                    break
                time.sleep(0.2)
            print(f"document {args.doc_tokens} tokens; interactive requests {args.requests} "
                  f"each (with text: solo {len(solo)}, during {len(busy)})")
            print(f"interactive TTFT p95 solo {p95(solo):.0f} ms, during the map-reduce "
                  f"{p95(busy):.0f} ms, ratio {p95(busy) / p95(solo):.2f}")
            print(f"median solo {statistics.median(solo):.0f} ms, during "
                  f"{statistics.median(busy):.0f} ms")
            print(f"job progress when the interactive sample ended: {progress_at_end}; "
                  f"job finished: {got['status']} ({got['requests']} requests, "
                  f"{time.perf_counter() - job_started:.0f} s after the sample)")
    finally:
        served.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
