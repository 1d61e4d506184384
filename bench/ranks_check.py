"""`python -m bench.ranks_check`: does a server on two ranks answer, and is its greedy output
the same as on one process?

For each server (ours, mlx_lm), on the model ``bench.serve --ranks 2`` uses: start it as one
process, ask a few fixed prompts (non-streaming chat completions, temperature 0, max_tokens
N), stop it; start it on the ranks, ask the same, stop it; then compare the texts. Prints
one JSON object (texts included: they are the benchmark's own prompts, not a household's)
and exits 0 only when every server answered on both and every text matched.

Run: ``python -m bench.ranks_check [--servers mlx_lm,ours] [--model DIR] [--max-tokens 8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import serve
from bench.chat_load import QUESTIONS
from bench.process import ServerStartError, free_port, running, wait_ready
from bench.serve_stats import MLX_LM

PROMPTS = (QUESTIONS[0], QUESTIONS[4])


async def ask(base_url: str, headers: dict[str, str], model: str | None, prompt: str,
              max_tokens: int, timeout_s: float) -> str:
    payload: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}],
                               "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    if model is not None:
        payload["model"] = model
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        resp = await client.post(f"{base_url}/v1/chat/completions", json=payload,
                                 headers=headers)
        resp.raise_for_status()
        return str(resp.json()["choices"][0]["message"]["content"])


async def answers(name: str, cfg: serve.Config, ranks: int, max_tokens: int,
                  timeout_s: float) -> dict[str, Any]:
    """Start ``name`` on ``ranks`` ranks, ask every prompt, stop it."""
    port = free_port(serve.HOST)
    log = cfg.output_dir / f"{name}-{ranks}rank.log"
    cfg.ranks = ranks
    server = (serve.make_ranked_server(name, cfg, port, log) if ranks > 1
              else serve.make_server(name, cfg, port, log))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    base_url = f"http://{serve.HOST}:{port}"
    result: dict[str, Any] = {"ranks": ranks, "log": str(log), "texts": [], "error": None}
    try:
        with running(server):
            await wait_ready(server, base_url, headers, cfg.ready_timeout_s)
            model = "default_model" if name == MLX_LM else None
            for prompt in PROMPTS:
                result["texts"].append(await asyncio.wait_for(
                    ask(base_url, headers, model, prompt, max_tokens, timeout_s), timeout_s))
    except (ServerStartError, httpx.HTTPError, OSError, KeyError, TimeoutError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


async def check(cfg: serve.Config, ranks: int, max_tokens: int,
                timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in cfg.servers:
        one = await answers(name, cfg, 1, max_tokens, timeout_s)
        many = await answers(name, cfg, ranks, max_tokens, timeout_s)
        ok = not one["error"] and not many["error"] and len(one["texts"]) == len(PROMPTS)
        out[name] = {"one_process": one, f"{ranks}_ranks": many,
                     "identical": ok and one["texts"] == many["texts"]}
        print(f"[check] {name}: identical={out[name]['identical']}", file=sys.stderr,
              flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ranks_check", description=__doc__)
    p.add_argument("--servers", default=f"{serve.OURS},{MLX_LM}")
    p.add_argument("--model", type=Path, default=None,
                   help="default: the Qwen 2 model bench.serve --ranks 2 uses")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--output-dir", type=Path, default=None)
    args = p.parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    serve_args = ["--servers", args.servers, "--ranks", str(args.ranks),
                  "--ready-timeout", "180"]
    serve_args += ["--model", str(args.model)] if args.model else []
    serve_args += ["--output-dir", str(args.output_dir)] if args.output_dir else []
    cfg = serve.config_from_args(serve.build_parser().parse_args(serve_args), "check", started)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    serve.apply_provisioning(cfg)
    results = asyncio.run(check(cfg, args.ranks, args.max_tokens, args.timeout))
    print(json.dumps({"model": str(cfg.model_dir), "max_tokens": args.max_tokens,
                      "prompts": list(PROMPTS), "servers": results}, indent=2))
    return 0 if all(r["identical"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
