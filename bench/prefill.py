"""`python -m bench.prefill`: prompt reading, the prompt cache and B = 1 decode,
ours against `mlx_lm.server` on the same model, same run (issue 10, part 4).

Each server is started alone, exactly as `python -m bench.serve` starts it (same
environment, same helpers), warmed up, then measured in three parts:

1. **Cold prefill**: single requests with distinct prompts of about each ``--lengths``
   tokens, max_tokens 1, ``--repeats`` times each: TTFT p50 and prompt tokens / TTFT.
2. **Multi-turn chat**: one user's conversation, each turn a new ~``--turn-tokens`` user
   message plus the previous answers (``--answer-tokens``), the whole history re-sent as
   chat clients do; each turn's TTFT, and for the last ``--cold-turns`` turns the TTFT of a
   fresh conversation of the same shape (other user texts, so no cached prefix).
3. **B = 1 decode** against the roofline: this machine's memory bandwidth (the best of a
   few numpy copies of a large array, read + write counted) over the bytes of all weights
   (each decoded token reads every parameter once) gives tokens/s at best; one streamed
   request of ``--decode-tokens`` tokens per repeat measures what each server reaches.

End-of-sequence is banned (``logit_bias``) so every answer has its full length.
Goals from the issue: cold prefill tokens/s ≥ mlx_lm's; multi-turn TTFT ≤ 0.3× cold;
decode ≥ 50 % of the roofline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from appliance.percentiles import percentile
from bench import chat_load, serve, summary
from bench import report as rep
from bench.client import RequestTiming, stream_chat
from bench.fairness_config import PromptMaker, eos_token_ids, token_counter
from bench.process import (
    ServerStartError,
    blas_facts,
    default_blas,
    free_port,
    run_guarded,
    wait_ready,
)
from bench.serve_stats import time_per_output_token

Messages = list[dict[str, str]]
COLD_GOAL, CACHE_GOAL, ROOFLINE_GOAL = 1.0, 0.3, 0.5

# --------------------------------------------------------------------------------------
# pure computations
# --------------------------------------------------------------------------------------


def best_bandwidth(nbytes_moved: int, times_s: Sequence[float]) -> float | None:
    """Bytes per second of the fastest of several runs that each moved `nbytes_moved`."""
    return rep.safe_ratio(float(nbytes_moved), min(times_s)) if times_s else None


def roofline_tokens_per_s(bandwidth_bps: float | None, weight_bytes: int) -> float | None:
    """B = 1 decode reads every weight once a token: at best bandwidth / weight bytes."""
    return rep.safe_ratio(bandwidth_bps, float(weight_bytes))


def cold_summary(length: int, timings: Sequence[RequestTiming]) -> dict[str, Any]:
    """One prompt length: TTFT p50 and prompt tokens (server-reported, else the target)
    read per second of it."""
    ok = [t for t in timings if t.ok and t.ttft_s is not None]
    counts = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
    tokens = percentile(counts, 50, "linear") if counts else float(length)
    ttft = percentile([t.ttft_s for t in ok if t.ttft_s is not None], 50, "linear")
    return {"length": length, "requests": len(timings), "ok": len(ok), "prompt_tokens": tokens,
            "ttft_p50_s": ttft, "prompt_tokens_per_s": rep.safe_ratio(tokens, ttft),
            "first_error": next((t.error for t in timings if t.error), None)}


def cold_ratios(ours: Sequence[Mapping[str, Any]], ref: Sequence[Mapping[str, Any]]
                ) -> list[dict[str, Any]]:
    """ours / mlx_lm per prompt length (prompt tokens/s: above 1 is better for ours)."""
    by_length = {r["length"]: r for r in ref}
    return [{"length": o["length"],
             "prompt_tokens_per_s": rep.safe_ratio(o["prompt_tokens_per_s"],
                                               by_length[o["length"]]["prompt_tokens_per_s"]),
             "ttft_p50": rep.safe_ratio(o["ttft_p50_s"], by_length[o["length"]]["ttft_p50_s"])}
            for o in ours if o["length"] in by_length]


def turn_rows(warm: Sequence[RequestTiming], cold: Mapping[int, RequestTiming]
              ) -> list[dict[str, Any]]:
    """Each turn's TTFT; where a cold request of the same shape was sent, its TTFT and
    warm / cold (the goal: at most 0.3)."""
    rows = []
    for turn, t in enumerate(warm, start=1):
        c = cold.get(turn)
        rows.append({"turn": turn, "prompt_tokens": t.prompt_tokens,
                     "cached_tokens": t.cached_tokens, "ttft_s": t.ttft_s, "error": t.error,
                     "cold_prompt_tokens": c.prompt_tokens if c else None,
                     "cold_ttft_s": c.ttft_s if c else None,
                     "warm_over_cold": rep.safe_ratio(t.ttft_s, c.ttft_s) if c else None})
    return rows


def decode_summary(timings: Sequence[RequestTiming], roofline: float | None) -> dict[str, Any]:
    """B = 1 decode: tokens/s from the mean time per output token, and its roofline share."""
    ok = [t for t in timings if t.ok]
    tpot = rep.mean([v for v in (time_per_output_token(t) for t in ok) if v is not None])
    rate = rep.safe_ratio(1.0, tpot)
    return {"requests": len(timings), "ok": len(ok),
            "output_tokens": [t.output_tokens for t in ok], "tokens_per_s": rate,
            "itl_p50_s": percentile([g for t in ok for g in t.inter_token_latencies], 50,
                                    "linear"),
            "roofline_share": rep.safe_ratio(rate, roofline),
            "first_error": next((t.error for t in timings if t.error), None)}


def goals(servers: Mapping[str, Mapping[str, Any]], ratios: Sequence[Mapping[str, Any]]
          ) -> dict[str, Any]:
    """Each goal's deciding figure (None: not measured) and whether it is met."""
    cold = [r["prompt_tokens_per_s"] for r in ratios]
    worst_cold = None if not cold or None in cold else min(cold)
    out: dict[str, Any] = {"cold_prefill_ours_over_mlx_lm": {
        "value": worst_cold, "goal": f">= {COLD_GOAL}",
        "met": None if worst_cold is None else worst_cold >= COLD_GOAL}}
    for name, s in servers.items():
        warm = [r["warm_over_cold"] for r in s.get("turns", []) if r["cold_ttft_s"] is not None]
        worst = None if not warm or None in warm else max(warm)
        share = (s.get("decode") or {}).get("roofline_share")
        out[f"{name}_multi_turn_over_cold"] = {
            "value": worst, "goal": f"<= {CACHE_GOAL}",
            "met": None if worst is None else worst <= CACHE_GOAL}
        out[f"{name}_decode_roofline_share"] = {
            "value": share, "goal": f">= {ROOFLINE_GOAL}",
            "met": None if share is None else share >= ROOFLINE_GOAL}
    return out


def errors_of(server: Mapping[str, Any]) -> list[str]:
    """Every error one server's run recorded: its start, cold lengths, turns, decode."""
    found = [server.get("error")]
    found += [r.get("first_error") for r in server.get("cold", [])]
    found += [r.get("error") for r in server.get("turns", [])]
    found.append((server.get("decode") or {}).get("first_error"))
    return [e for e in found if e]


def conversation(user_texts: Sequence[str], answers: Sequence[str]) -> Messages:
    """user, assistant, user, ...: a chat history ending with the last user message."""
    messages: Messages = []
    for i, text in enumerate(user_texts):
        messages.append({"role": "user", "content": text})
        if i < len(user_texts) - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


# --------------------------------------------------------------------------------------
# rendering (pure)
# --------------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.0f}"


def _num(v: float | None, fmt: str = ".0f") -> str:
    return "–" if v is None else format(v, fmt)


def render(report: Mapping[str, Any]) -> str:
    meta, servers, bw = report["meta"], report["servers"], report["bandwidth"]
    lines = [f"### Prefill, prompt cache and decode roofline: {', '.join(servers)} "
             f"({meta['date']})", "", f"- command: `{meta['command']}`",
             f"- model: `{meta['model']['path']}` ({rep.describe_model(meta['model'])}), "
             f"{meta['model'].get('parameter_bytes', 0) / 1e6:.1f} MB of weights",
             f"- git commit: `{meta['git_commit']}`; machine: {meta['machine']}; BLAS: "
             f"{meta['blas']}; max batch {meta['max_batch_size']}",
             f"- workload: cold lengths {meta['lengths']} × {meta['repeats']}; {meta['turns']} "
             f"turns of ~{meta['turn_tokens']} user tokens + {meta['answer_tokens']}-token "
             f"answers; decode {meta['decode_tokens']} tokens × {meta['repeats']}; "
             "temperature 0, EOS banned"]
    lines += [f"- {name}: `{s['command']}` (log `{s['log']}`)" for name, s in servers.items()]
    lines += ["", "**Cold prefill** (distinct prompts, max_tokens 1):", "",
              "| length | server | ok | prompt tokens | TTFT p50 ms | prompt tok/s |",
              "|---:|---|---:|---:|---:|---:|"]
    ratio_by = {r["length"]: r for r in report["ratios"]}
    for length in meta["lengths"]:
        for name, s in servers.items():
            for r in (r for r in s.get("cold", []) if r["length"] == length):
                lines.append(f"| {length} | {name} | {r['ok']}/{r['requests']} | "
                             f"{_num(r['prompt_tokens'])} | {_ms(r['ttft_p50_s'])} | "
                             f"{_num(r['prompt_tokens_per_s'], '.1f')} |")
        if length in ratio_by:
            lines.append(f"| {length} | ours/mlx_lm | | | "
                         f"{_num(ratio_by[length]['ttft_p50'], '.2f')}× | "
                         f"**{_num(ratio_by[length]['prompt_tokens_per_s'], '.2f')}×** |")
    lines += ["", "**Multi-turn chat with the prompt cache** (cold: a fresh conversation of "
              "the same shape):", "",
              "| turn | server | prompt tokens | cached | TTFT ms | cold prompt tokens | "
              "cold TTFT ms | warm/cold |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in servers.items():
        for r in s.get("turns", []):
            lines.append(f"| {r['turn']} | {name} | {_num(r['prompt_tokens'])} | "
                         f"{_num(r['cached_tokens'])} | {_ms(r['ttft_s'])} | "
                         f"{_num(r['cold_prompt_tokens'])} | {_ms(r['cold_ttft_s'])} | "
                         f"{_num(r['warm_over_cold'], '.2f')} |")
    lines += ["", f"**B = 1 decode against the roofline**: memory bandwidth "
              f"{_num(rep.safe_ratio(bw['bytes_per_s'], 1e9), '.2f')} GB/s ({bw['method']}"
              f"); roofline {_num(report['roofline_tokens_per_s'], '.1f')} tokens/s "
              "(bandwidth / weight bytes)", "",
              "| server | ok | tokens/s | ITL p50 ms | share of roofline |",
              "|---|---:|---:|---:|---:|"]
    for name, s in servers.items():
        d = s.get("decode") or {}
        share = d.get("roofline_share")
        lines.append(f"| {name} | {d.get('ok', 0)}/{d.get('requests', 0)} | "
                     f"{_num(d.get('tokens_per_s'), '.1f')} | {_ms(d.get('itl_p50_s'))} | "
                     f"{'–' if share is None else f'{share:.0%}'} |")
    lines += ["", "Goals:"]
    for key, g in report["goals"].items():
        state = {True: "met", False: "**not met**", None: "not measured"}[g["met"]]
        lines.append(f"- {key}: {_num(g['value'], '.2f')} (goal {g['goal']}): {state}")
    for name, s in servers.items():
        lines += [f"- {name} error: {e}" for e in errors_of(s)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------


def measure_bandwidth(mib: int, repeats: int) -> dict[str, Any]:
    """Copy a `mib` MiB float64 array `repeats` times; best bytes/s (read + write)."""
    import numpy as np

    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return {"method": f"best of {repeats} numpy copies of {mib} MiB, read + write counted, "
            "one thread", "bytes_per_s": best_bandwidth(2 * src.nbytes, times),
            "times_s": times}


async def ask(client: httpx.AsyncClient, target: chat_load.Target, messages: Messages,
              max_tokens: int, bias: Mapping[str, float]) -> RequestTiming:
    payload = chat_load.chat_payload(target, "", max_tokens, include_usage=True)
    payload.update(messages=messages, logit_bias=dict(bias))
    return await stream_chat(client, f"{target.base_url}/v1/chat/completions", payload,
                             target.headers)


async def measure(target: chat_load.Target, args: argparse.Namespace, roofline: float | None
                  ) -> dict[str, Any]:
    """The three parts on one running server. Same seed for every server: same texts."""
    rng = random.Random(args.seed)
    make = PromptMaker(token_counter(args.model))
    bias = {str(i): -100.0 for i in eos_token_ids(args.model)}
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        cold: dict[int, list[RequestTiming]] = {n: [] for n in args.lengths}
        for _ in range(args.repeats):
            for n in args.lengths:
                text = make.make((n, n), rng)
                cold[n].append(await ask(client, target, conversation([text], []), 1, bias))
        users: list[str] = []
        warm: list[RequestTiming] = []
        for _ in range(args.turns):
            users.append(make.make((args.turn_tokens, args.turn_tokens), rng))
            warm.append(await ask(client, target, conversation(users, [t.text for t in warm]),
                                  args.answer_tokens, bias))
        fresh: dict[int, RequestTiming] = {}
        for turn in range(max(1, args.turns - args.cold_turns + 1), args.turns + 1):
            other = [make.make((args.turn_tokens, args.turn_tokens), rng) for _ in range(turn)]
            fresh[turn] = await ask(client, target, conversation(
                other, [t.text for t in warm]), args.answer_tokens, bias)
        decode = [await ask(client, target, conversation([make.make((32, 32), rng)], []),
                            args.decode_tokens, bias) for _ in range(args.repeats)]
    return {"cold": [cold_summary(n, cold[n]) for n in args.lengths],
            "turns": turn_rows(warm, fresh), "decode": decode_summary(decode, roofline)}


async def bench_server(name: str, scfg: serve.Config, args: argparse.Namespace,
                       roofline: float | None) -> dict[str, Any]:
    """Start one server, warm it up, measure, stop it (by its PID)."""
    port = free_port(serve.HOST)
    server = serve.make_server(name, scfg, port, scfg.output_dir / f"{name}.log")
    headers = {"Authorization": f"Bearer {scfg.api_key}"} if scfg.api_key else {}
    info: dict[str, Any] = {"command": rep.display_command(server.argv),
                            "log": rep.relative(server.log_path), "error": None}
    print(f"[prefill] starting {name}: {info['command']}", file=sys.stderr, flush=True)
    try:
        with serve.running(server):
            base = f"http://{serve.HOST}:{port}"
            await wait_ready(server, base, headers, scfg.ready_timeout_s)
            info.update(blas_facts(server))
            model = ("default_model" if name == serve.MLX_LM else
                     await chat_load.discover_model(chat_load.Target(name, base, headers, None)))
            target = chat_load.Target(name, base, headers, model)
            await chat_load.warm_up(target, scfg.workload)
            info.update(await measure(target, args, roofline))
    except (ServerStartError, RuntimeError, httpx.HTTPError, OSError) as exc:
        print(f"[prefill] {name} failed: {exc}", file=sys.stderr, flush=True)
        info["error"] = str(exc)
    return info


async def bench_all(scfg: serve.Config, args: argparse.Namespace, roofline: float | None
                    ) -> dict[str, dict[str, Any]]:
    return {name: await bench_server(name, scfg, args, roofline) for name in scfg.servers}


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------


def parse_lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 8:
        raise argparse.ArgumentTypeError("lengths must be integers >= 8, e.g. 512,1024,1800")
    return lengths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.prefill",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help=f"model directory (default: {serve.DEFAULT_MODEL_DIR}, built once)")
    p.add_argument("--servers", default=f"{serve.OURS},{serve.MLX_LM}",
                   help="servers to run, in order (default: ours,mlx_lm)")
    p.add_argument("--lengths", type=parse_lengths, default=[512, 1024, 1800],
                   help="cold prompt lengths in tokens; keep them within the model's "
                   "context (default: 512,1024,1800)")
    p.add_argument("--repeats", type=int, default=3,
                   help="requests per cold length, and decode requests (default: 3)")
    p.add_argument("--turns", type=int, default=7,
                   help="turns of the conversation (default 7: about 1,000 tokens)")
    p.add_argument("--turn-tokens", type=int, default=100, help="tokens of each user message")
    p.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of each answer")
    p.add_argument("--cold-turns", type=int, default=2,
                   help="last turns compared with a cold request (default: 2)")
    p.add_argument("--decode-tokens", type=int, default=128,
                   help="output tokens of each decode request (default: 128)")
    p.add_argument("--bandwidth-mib", type=int, default=256,
                   help="size of the array copied to measure bandwidth (default: 256)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output-dir", type=Path, default=None,
                   help="logs and report (default: .bench/prefill/<time>)")
    summary.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run it; print the Markdown report; 0 when every server ran without errors."""
    prog = "python -m bench.prefill"
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(args_list)
    if min(args.repeats, args.turns, args.turn_tokens, args.answer_tokens,
           args.decode_tokens) < 1 or args.cold_turns < 0 or args.decode_tokens < 2:
        raise SystemExit("--repeats, --turns, --turn-tokens and --answer-tokens must be at "
                         "least 1, --decode-tokens at least 2, --cold-turns not negative")
    started = dt.datetime.now(dt.UTC)
    out = (args.output_dir or Path(".bench/prefill") / started.strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    args.model = serve.resolve_model(args.model)
    exe = shlex.quote(sys.executable)
    scfg = serve.Config(
        model_dir=args.model, servers=[s for s in args.servers.split(",") if s],
        workload=chat_load.Workload(concurrency=[1], requests_per_client=1, max_tokens=8,
                                include_usage=True, warmup=True, request_timeout_s=600.0),
        max_batch_size=args.max_batch_size, blas=default_blas(), api_key=args.api_key,
        our_cmd=shlex.split(f"{exe} -m appliance serve"), our_env={},
        mlx_cmd=shlex.split(f"{exe} -m mlx_lm server"), output_dir=out.resolve(),
        ready_timeout_s=300.0, command="")
    if serve.OURS in scfg.servers:
        serve.apply_provisioning(scfg)
    facts = dict(rep.model_facts(args.model), path=rep.relative(args.model))
    bandwidth = measure_bandwidth(args.bandwidth_mib, 5)
    roofline = roofline_tokens_per_s(bandwidth["bytes_per_s"], facts["parameter_bytes"])
    servers = run_guarded(bench_all(scfg, args, roofline), out)
    if servers is None:
        return 130
    ratios = (cold_ratios(servers[serve.OURS].get("cold", []),
                          servers[serve.MLX_LM].get("cold", []))
              if serve.OURS in servers and serve.MLX_LM in servers else [])
    meta = {"date": started.isoformat(timespec="seconds"),
            "command": shlex.join([*prog.split(), *args_list]),
            "model": facts, "git_commit": rep.git_commit(serve.REPO_ROOT),
            "machine": serve.machine_description(), "versions": serve.package_versions(),
            "blas": scfg.blas, "max_batch_size": args.max_batch_size, "lengths": args.lengths,
            "repeats": args.repeats, "turns": args.turns, "turn_tokens": args.turn_tokens,
            "answer_tokens": args.answer_tokens, "cold_turns": args.cold_turns,
            "decode_tokens": args.decode_tokens, "seed": args.seed}
    report = {"meta": meta, "bandwidth": bandwidth, "roofline_tokens_per_s": roofline,
              "servers": servers, "ratios": ratios, "goals": goals(servers, ratios)}
    summary.write_report(out, render(report), report, "prefill", args)
    failed = any(errors_of(s) for s in servers.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
