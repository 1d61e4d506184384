"""`python -m bench.goodput`: open-loop Poisson arrivals of a household mix at increasing
rates against OpenAI-compatible servers; per rate the share of requests meeting their
class's SLO, and the goodput (the highest rate at which >= 90 % meet it).

By default it starts ours and `mlx_lm.server` on the same model (both kept running, driven
one after the other at each rate, the order alternating from rate to rate) exactly as
`python -m bench.serve` does; ``--url NAME=URL`` drives any server already running instead.
The mix, its seeded length distributions and the SLOs are in goodput_stats.py. Our server
is told each request's class (``x-appliance-class``); other servers ignore the header.
Plots (PNG, matplotlib when installed): SLO attainment against rate, and the batch the
server held (mean requests in flight) against TTFT p95 and ITL p95 (the frontier).

Run: ``python -m bench.goodput [--rates 0.05,0.1,0.2] [--duration 60] [--seed 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from appliance.vocab import Klass
from bench import chat_load, serve, summary
from bench.client import stream_chat
from bench.goodput_stats import (
    CLASSES,
    MIX,
    Arrival,
    Outcome,
    RateResult,
    goodput,
    goodput_ratio,
    schedule,
    summarize_rate,
)
from bench.process import blas_facts, default_blas, free_port, run_guarded, wait_ready
from bench.report import (
    describe_model,
    display_command,
    git_commit,
    model_facts,
    relative,
)
from bench.summary import write_report

WORDS = ["kitchen", "light", "garden", "window", "heating", "water", "bread", "table", "evening", "morning", "door", "radio", "garage", "kettle", "winter", "dinner", "school", "bicycle", "laundry", "battery", "market", "letter", "music", "rain", "shelf", "clock", "pillow", "tomato", "basket", "candle", "ladder", "blanket", "stairs", "meeting"]


def prompt_text(a: Arrival) -> str:
    """A distinct prompt of ``a.prompt_words`` words (its serial first: no cache replay)."""
    words = [WORDS[(a.serial * 7 + i * 13) % len(WORDS)] for i in range(a.prompt_words)]
    lead = {"voice": "Command", "chat": "Question", "document": "Summarise this note"}[a.klass]
    return f"{lead} {a.serial}: " + " ".join(words)


async def one_request(client: httpx.AsyncClient, target: chat_load.Target, a: Arrival,
                      t0: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + a.at_s - time.perf_counter()))
    sent = time.perf_counter() - t0
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt_text(a)}],
        "max_tokens": a.max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}}
    if target.model is not None:
        payload["model"] = target.model
    headers = dict(target.headers, **{"x-appliance-class": CLASSES[a.klass].header})
    timing = await stream_chat(client, f"{target.base_url}/v1/chat/completions", payload,
                               headers, index=a.serial)
    return Outcome(klass=a.klass, ok=timing.ok, ttft_s=timing.ttft_s, total_s=timing.duration_s,
                   itls=tuple(timing.inter_token_latencies), sent_s=sent, error=timing.error)


async def run_rate(target: chat_load.Target, arrivals: list[Arrival], timeout_s: float
                   ) -> list[Outcome]:
    limits = httpx.Limits(max_connections=len(arrivals) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30)
                                 ) as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(one_request(client, target, a, t0)
                                           for a in arrivals)))


async def drive(cfg: argparse.Namespace, targets: dict[str, chat_load.Target]
                ) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
    for i, rate in enumerate(cfg.rates):
        arrivals = schedule(rate, cfg.duration, cfg.seed)
        names = list(targets) if i % 2 == 0 else list(reversed(targets))
        for name in names:
            outcomes = await run_rate(targets[name], arrivals, cfg.request_timeout)
            r = summarize_rate(rate, outcomes, cfg.slo_scale)
            results[name].append(asdict(r))
            print(f"[goodput] {name} rate {rate:g}/s: {r.requests} requests, "
                  f"{r.attainment:.0%} met SLO, in flight {r.mean_in_flight:.1f}, "
                  f"{r.errors} errors{f' (first: {r.first_error})' if r.first_error else ''}",
                  file=sys.stderr, flush=True)
    return results


async def with_servers(cfg: argparse.Namespace, scfg: serve.Config) -> dict[str, Any]:
    """Start the servers (or take --url ones), run every rate, stop what we started."""
    info: dict[str, Any] = {}
    targets: dict[str, chat_load.Target] = {}
    headers = {"Authorization": f"Bearer {scfg.api_key}"} if scfg.api_key else {}
    with contextlib.ExitStack() as stack:
        for name in scfg.servers:
            port = free_port(serve.HOST)
            server = serve.make_server(name, scfg, port, scfg.output_dir / f"{name}.log")
            stack.enter_context(serve.running(server))
            base = f"http://{serve.HOST}:{port}"
            await wait_ready(server, base, headers, scfg.ready_timeout_s)
            model = ("default_model" if name == serve.MLX_LM else
                     await chat_load.discover_model(chat_load.Target(name, base, headers, None)))
            targets[name] = chat_load.Target(name, base, headers, model)
            info[name] = {"command": display_command(server.argv),
                          "log": relative(server.log_path),
                          **blas_facts(server)}
            await chat_load.warm_up(targets[name], scfg.workload)
        for name, url in cfg.url:
            targets[name] = chat_load.Target(name, url.rstrip("/"), headers, None)
            targets[name].model = await chat_load.discover_model(targets[name])
            info[name] = {"command": f"(already running at {url})", "log": None}
        results = await drive(cfg, targets)
    return {"servers": info, "results": results}


def render(report: dict[str, Any]) -> str:
    meta, results = report["meta"], report["results"]
    names = list(results)
    lines = [f"### Goodput benchmark: {', '.join(names)} ({meta['date']})", "",
             f"- command: `{meta['command']}`",
             f"- model: `{relative(meta['model']['path'])}` "
             f"({describe_model(meta['model'])})",
             f"- git commit: `{meta['git_commit']}`; machine: {meta['machine']}",
             f"- arrivals: Poisson, {meta['duration_s']:g} s per rate, seed {meta['seed']}; "
             f"SLO scale {meta['slo_scale']:g}; mix: " + "; ".join(
                 f"{c.name} {c.share:.0%} ({c.prompt_words[0]}-{c.prompt_words[1]} words, "
                 f"{c.output_tokens[0]}-{c.output_tokens[1]} tokens)" for c in MIX)]
    for name, s in report["servers"].items():
        lines.append(f"- {name}: `{s['command']}`")
    lines += ["", "| rate /s | server | requests | met SLO | voice | chat | document | "
              "in flight | TTFT p50 ms | TTFT p95 ms | ITL p95 ms |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(v: float | None) -> str:
        return "–" if v is None else f"{v:.0%}"

    def ms(v: float | None) -> str:
        return "–" if v is None else f"{v * 1000:.0f}"
    for i, rate in enumerate(meta["rates"]):
        for name in names:
            r = results[name][i]
            lines.append(f"| {rate:g} | {name} | {r['requests']} | {pct(r['attainment'])} | "
                         + " | ".join(pct(r['by_class'].get(c.name)) for c in MIX)
                         + f" | {r['mean_in_flight']:.1f} | {ms(r['ttft_p50_s'])} | "
                         f"{ms(r['ttft_p95_s'])} | {ms(r['itl_p95_s'])} |")
    lines.append("")
    for name in names:
        for r in results[name]:
            if r.get("errors"):
                lines.append(f"- {name} at {r['rate']:g}/s: {r['errors']} failed requests, "
                             f"first: {r['first_error']}")
    for name in names:
        g = report["goodput"][name]
        lines.append(f"- goodput {name}: {'below the lowest rate' if g is None else f'{g:g}/s'}")
    if "ratio" in report:
        value, note = report["ratio"]
        lines.append(f"- goodput ours/mlx_lm: {'–' if value is None else f'**{value:.2f}×**'}"
                     + (f" ({note})" if note else ""))
    if report.get("plot"):
        lines.append(f"- plot: `{report['plot']}`")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """SLO attainment vs rate, and the batch held vs TTFT/ITL p95; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in report["results"].items():
        rates = [r["rate"] for r in rows]
        a.plot(rates, [r["attainment"] * 100 for r in rows], marker="o", label=name)
        inflight = [r["mean_in_flight"] for r in rows]
        b.plot(inflight, [(r["ttft_p95_s"] or 0) * 1000 for r in rows], marker="o",
               label=f"{name} TTFT p95")
        b.plot(inflight, [(r["itl_p95_s"] or 0) * 1000 for r in rows], marker="s",
               linestyle="--", label=f"{name} ITL p95")
    a.axhline(90, color="grey", linewidth=0.8)
    a.set(xlabel="arrival rate (requests/s)", ylabel="requests meeting their SLO (%)",
          title="SLO attainment", ylim=(0, 105))
    b.set(xlabel="mean requests in flight (batch held)", ylabel="ms", yscale="log",
          title="batch size vs TTFT / ITL p95")
    a.legend()
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_rates(text: str) -> list[float]:
    rates = sorted(float(x) for x in text.split(",") if x.strip())
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError("rates must be positive, e.g. 0.05,0.1,0.2")
    return rates


def parse_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not url.startswith("http"):
        raise argparse.ArgumentTypeError("--url expects NAME=http://host:port")
    return name, url


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help=f"model directory (default: {serve.DEFAULT_MODEL_DIR}, built once)")
    p.add_argument("--servers", default=f"{serve.OURS},{serve.MLX_LM}",
                   help="servers to start (default ours,mlx_lm; empty with --url)")
    p.add_argument("--url", type=parse_url, action="append", default=[],
                   help="NAME=URL of a server already running (repeatable)")
    p.add_argument("--rates", type=parse_rates, default=[0.05, 0.1, 0.2, 0.4],
                   help="arrival rates in requests/s (default 0.05,0.1,0.2,0.4)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--slo-scale", type=float, default=1.0, help="multiply every SLO time")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output-dir", type=Path, default=None)
    summary.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    cfg = build_parser().parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    out = cfg.output_dir or Path(".bench/goodput") / started.strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    model = serve.resolve_model(cfg.model)
    servers = [s for s in cfg.servers.split(",") if s]
    workload = chat_load.Workload(concurrency=[1, 4], requests_per_client=1, max_tokens=8,
                              include_usage=True, warmup=True, request_timeout_s=600.0)
    exe = shlex.quote(sys.executable)
    scfg = serve.Config(model_dir=model, servers=servers, workload=workload,
                        max_batch_size=cfg.max_batch_size, blas=default_blas(),
                        api_key=cfg.api_key, our_cmd=shlex.split(f"{exe} -m appliance serve"),
                        our_env={}, mlx_cmd=shlex.split(f"{exe} -m mlx_lm server"),
                        output_dir=out, ready_timeout_s=300.0, command="")
    if serve.OURS in servers:
        serve.apply_provisioning(scfg, max_class=Klass.VOICE)
    got = run_guarded(with_servers(cfg, scfg), out)
    if got is None:
        return 1
    results = {name: [RateResult(**r) for r in rows] for name, rows in got["results"].items()}
    report: dict[str, Any] = {
        "meta": {"date": started.isoformat(timespec="seconds"),
                 "command": "python -m bench.goodput " + shlex.join(argv or sys.argv[1:]),
                 "model": model_facts(model), "git_commit": git_commit(serve.REPO_ROOT),
                 "machine": serve.machine_description(), "rates": cfg.rates,
                 "duration_s": cfg.duration, "seed": cfg.seed, "slo_scale": cfg.slo_scale},
        "servers": got["servers"], "results": got["results"],
        "goodput": {name: goodput(rows) for name, rows in results.items()},
    }
    if serve.OURS in results and serve.MLX_LM in results:
        report["ratio"] = goodput_ratio(report["goodput"][serve.OURS],
                                        report["goodput"][serve.MLX_LM], cfg.rates[0])
    png = out / "goodput.png"
    if plot(report, png):
        report["plot"] = relative(png)
    write_report(out, render(report), report, "goodput", cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
