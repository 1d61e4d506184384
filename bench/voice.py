"""The voice hook beside a background backlog: its time to first token against solo.

    python -m bench.voice --model appliance/demo_model --summary bench/results/voice-NAME.json

Starts ``appliance serve`` as a child process (its own data folder; a ``ha`` user whose key
has the default class ``voice``, and ``bob``), then alternates blocks of ``POST
/hooks/voice`` requests alone (solo) and beside ``--backlog`` background streams of
``/v1/completions`` kept running by bob (backlog), so that any other load on the machine
hits both. It reports p50/p95 of the hook's own ``timings.ttft_ms`` and ``total_ms``, the
p95 ratio backlog/solo, and how many answers missed their deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from appliance.percentiles import percentile
from appliance.vocab import FinishReason, Klass
from bench import summary
from bench.process import ServerProcess, free_port, running, wait_ready
from bench.provision import DATA_DIR_ENV, BenchUser, provision
from bench.report import safe_ratio

QUESTIONS = ["turn on the kitchen light", "is the front door locked", "what time is it",
             "dim the living room lamp", "good night"]


HOUSEHOLD = (BenchUser("ha", max_class=Klass.VOICE, default_class=Klass.VOICE),
             BenchUser("bob"))
"""Home Assistant's user (its key asks for ``voice``) and bob, whose stories back up."""


async def _backlog_stream(client: httpx.AsyncClient, key: str, max_tokens: int,
                          stop: asyncio.Event) -> None:
    body = {"prompt": "Tell a long story about a lighthouse.", "max_tokens": max_tokens,
            "stream": True, "temperature": 0.8}
    headers = {"Authorization": f"Bearer {key}", "X-Appliance-Class": Klass.BACKGROUND.label}
    while not stop.is_set():
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers=headers) as r:
            async for _ in r.aiter_lines():
                if stop.is_set():
                    break


async def _hook(client: httpx.AsyncClient, key: str, i: int, max_tokens: int
                ) -> dict[str, Any]:
    r = await client.post("/hooks/voice", headers={"Authorization": f"Bearer {key}"},
                          json={"text": QUESTIONS[i % len(QUESTIONS)],
                                "max_tokens": max_tokens})
    r.raise_for_status()
    return dict(r.json())


async def _measure(url: str, ha: str, bob: str, args: argparse.Namespace
                   ) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"solo": [], "backlog": []}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for block in range(args.blocks):
            for i in range(args.per_block):
                out["solo"].append(await _hook(client, ha, i, args.max_tokens))
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_backlog_stream(client, bob, args.backlog_tokens,
                                                         stop)) for _ in range(args.backlog)]
            await asyncio.sleep(args.warmup_s)
            for i in range(args.per_block):
                out["backlog"].append(await _hook(client, ha, i, args.max_tokens))
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(1.0)
            print(f"block {block + 1}/{args.blocks} done", flush=True)
    return out


def _row(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["timings"]["ttft_ms"] for r in rows if r["timings"]["ttft_ms"] is not None]
    total = [r["timings"]["total_ms"] for r in rows]
    return {"phase": name, "n": len(rows), "ttft_p50_ms": percentile(ttft, 50, "linear"),
            "ttft_p95_ms": percentile(ttft, 95, "linear"),
            "total_p50_ms": percentile(total, 50, "linear"),
            "total_p95_ms": percentile(total, 95, "linear"),
            "deadline_misses": sum(r["finish_reason"] == FinishReason.DEADLINE for r in rows)}


def _markdown(rows: list[dict[str, Any]], ratio: float | None, argv: list[str]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    lines = ["| phase | requests | TTFT p50 ms | TTFT p95 ms | total p50 ms | total p95 ms "
             "| deadline misses |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['n']} | {fmt(r['ttft_p50_ms'])} | "
                     f"{fmt(r['ttft_p95_ms'])} | {fmt(r['total_p50_ms'])} | "
                     f"{fmt(r['total_p95_ms'])} | {r['deadline_misses']} |")
    lines.append("")
    lines.append(f"TTFT p95 backlog/solo: {'-' if ratio is None else f'{ratio:.2f}'}x")
    lines.append(f"command: `python -m bench.voice {' '.join(argv)}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--out", type=Path, default=Path(".bench/voice"),
                   help="the run's folder: server log and Markdown (git-ignored)")
    summary.add_arguments(p)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--per-block", type=int, default=5)
    p.add_argument("--backlog", type=int, default=8)
    p.add_argument("--backlog-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--warmup-s", type=float, default=2.0)
    args = p.parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="bench-voice-"))
    keys = provision(data_dir, HOUSEHOLD, os.environ)
    ha, bob = keys["ha"], keys["bob"]
    port = free_port()
    server = ServerProcess(
        "appliance", [sys.executable, "-m", "appliance", "serve", "--port", str(port),
                      "--max-batch-size", str(args.max_batch_size),
                      *(["--model", args.model] if args.model else [])],
        {**os.environ, DATA_DIR_ENV: str(data_dir)}, args.out / "server.log")
    url = f"http://127.0.0.1:{port}"
    with running(server):
        asyncio.run(wait_ready(server, url, {}, 300))
        started = time.time()
        result = asyncio.run(_measure(url, ha, bob, args))
    rows = [_row(k, v) for k, v in result.items()]
    ratio = safe_ratio(rows[1]["ttft_p95_ms"], rows[0]["ttft_p95_ms"])
    md = _markdown(rows, ratio, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "voice.md").write_text(md)
    summary.keep("voice", {"rows": rows, "ratio_ttft_p95": ratio, "started": started,
                           "raw": result}, args.summary, args.trace, args.out)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
