"""`python -m bench.serve`: our server against `mlx_lm.server` on the same model directory
and llama.cpp's `llama-server` on the same GGUF file, same run.

Each server is started alone (one at a time) on a free 127.0.0.1 port with the same
environment (OpenBLAS preloaded by default on Linux), warmed up, then driven by C = 1, 2, 4, 8
concurrent streaming chat clients; each client sends N requests back to back. For every level
we report aggregate output tokens/s, TTFT p50/p95 (request sent → first text chunk) and
inter-token latency p50/p95 (gaps between text chunks), and the ratios ours/mlx_lm. The
machine is shared and noisy, so only the ratios measured in the same run mean much. With
``--stagger-ms MS`` every level runs a second time with its clients starting MS ms apart,
and the report sets the running streams' ITL p95 then against the steady run's.

Run: ``python -m bench.serve [--model DIR] [--requests-per-client N] [--summary PATH]``;
``--servers ours,mlx_lm,llama_cpp --gguf FILE`` adds llama-server (built by
``bench/peers/build-llama-server.sh``) with one slot per client of the highest level.
``--ranks 2`` runs ours and mlx_lm each on two ranks of this machine (:mod:`bench.ranks`),
each rank pinned to a core of its own, on a Qwen 2-shaped model both can pipeline (by
default the SmolLM-135M-shaped one as Qwen 2, :mod:`bench.qwen2_model`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.vocab import Klass
from bench import ranks as rank_setup
from bench import summary
from bench.chat_load import Target, Workload, discover_model, run_level, warm_up
from bench.client import RequestTiming
from bench.peers import llama_cpp
from bench.process import (
    OPENBLAS_PATH,
    Server,
    ServerGroup,
    ServerProcess,
    ServerStartError,
    blas_facts,
    blas_report,
    default_blas,
    free_port,
    resident,
    run_guarded,
    running,
    server_env,
    wait_ready,
)
from bench.provision import DATA_DIR_ENV, BenchUser, provision
from bench.report import (
    display_command,
    git_commit,
    model_facts,
    relative,
    safe_ratio,
)
from bench.serve_stats import (
    LLAMA_CPP,
    MLX_LM,
    OURS,
    LevelStats,
    compute_ratios,
    fmt_ms,
    fmt_rate,
    render_report,
    summarize_level,
)
from bench.summary import write_report

SERVER_NAMES = (OURS, MLX_LM, LLAMA_CPP)
HOST = "127.0.0.1"
DEFAULT_MODEL_SHAPE = "smollm-135m"
DEFAULT_MODEL_DIR = Path(".bench/models") / DEFAULT_MODEL_SHAPE
DEFAULT_RANKS_MODEL_DIR = Path(".bench/models") / "qwen2-135m"
"""--ranks > 1 without --model: the default model as Qwen 2, which mlx_lm can pipeline."""
DEFAULT_OUTPUT_ROOT = Path(".bench/serve")
REPO_ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------


@dataclass
class Config:
    model_dir: Path | None
    """The MLX model directory of ours and mlx_lm (None when only llama_cpp runs)."""
    servers: list[str]
    workload: Workload
    max_batch_size: int
    blas: str
    api_key: str | None
    our_cmd: list[str]
    our_env: dict[str, str]
    mlx_cmd: list[str]
    output_dir: Path
    ready_timeout_s: float
    command: str
    rounds: int = 1
    auth: str = "none"
    gguf: Path | None = None
    """The GGUF file llama_cpp serves (the same weights as model_dir, as a household has them)."""
    llama_cmd: list[str] = field(default_factory=list)
    llama_threads: int = 2
    ranks: int = 1
    """Ranks each of ours and mlx_lm runs on (1: one process, as ever)."""
    pin: bool = True
    """With ranks > 1: each rank on a core of its own."""
    join_cmd: list[str] = field(default_factory=list)
    """Command prefix of our followers (``appliance join``)."""


def server_argv(name: str, cfg: Config, port: int) -> list[str]:
    """The full command line of one server under test."""
    if name == LLAMA_CPP:
        assert cfg.gguf is not None
        return llama_cpp.argv(cfg.llama_cmd, cfg.gguf, HOST, port, cfg.max_batch_size,
                              cfg.llama_threads, cfg.workload.prompt_words,
                              cfg.workload.max_tokens)
    common = ["--model", str(cfg.model_dir), "--host", HOST, "--port", str(port)]
    if name == OURS:
        return [*cfg.our_cmd, *common, "--max-batch-size", str(cfg.max_batch_size)]
    # mlx_lm batches up to --decode-concurrency sequences (default 32) and prefills up to
    # --prompt-concurrency prompts together (default 8): cap both at our max batch size.
    batch = str(cfg.max_batch_size)
    return [*cfg.mlx_cmd, *common, "--decode-concurrency", batch, "--prompt-concurrency", batch]


def make_server(name: str, cfg: Config, port: int, log: Path) -> ServerProcess:
    env = server_env(cfg.blas)
    if name == OURS:
        # Our CLI preloads OpenBLAS by itself unless told otherwise: keep both servers on
        # the same BLAS.
        env["APPLIANCE_BLAS"] = cfg.blas
        env.update(cfg.our_env)
    return ServerProcess(
        name=name,
        argv=server_argv(name, cfg, port),
        env=env,
        log_path=log,
    )


def make_ranked_server(name: str, cfg: Config, port: int, log: Path) -> ServerGroup:
    """ours or mlx_lm on ``cfg.ranks`` ranks of this machine, with fresh ring ports."""
    assert cfg.model_dir is not None and cfg.ranks > 1
    plan = rank_setup.plan_ranks(cfg.ranks, log.with_name(f"{log.stem}-hostfile.json"), cfg.pin,
                                 HOST)
    if name == MLX_LM:
        return rank_setup.mlx_lm_group(plan, cfg.mlx_cmd, cfg.model_dir, HOST, port,
                                       cfg.max_batch_size, server_env(cfg.blas), log)
    env = {**server_env(cfg.blas), "APPLIANCE_BLAS": cfg.blas, **cfg.our_env}
    return rank_setup.ours_group(plan, cfg.our_cmd, cfg.join_cmd, cfg.model_dir, HOST, port,
                                 cfg.max_batch_size, env, log)


def needs_provisioning(cfg: Config) -> bool:
    """Our server needs an API key and the user gave neither a key nor a data directory."""
    return OURS in cfg.servers and cfg.api_key is None and DATA_DIR_ENV not in cfg.our_env


def apply_provisioning(cfg: Config, max_class: Klass = Klass.INTERACTIVE) -> None:
    """Give our server a throwaway data dir (in the output directory) with one ``bench``
    user and its key, when the user did not bring their own."""
    if not needs_provisioning(cfg):
        return
    data_dir = (cfg.output_dir / "ours-data").resolve()
    try:
        key = provision(data_dir, [BenchUser("bench", max_class=max_class)],
                        {**server_env(cfg.blas), **cfg.our_env})["bench"]
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(
            f"[bench] could not provision an API key for ours ({exc}); pass --api-key "
            f"and --our-env {DATA_DIR_ENV}=DIR",
            file=sys.stderr,
            flush=True,
        )
        return
    cfg.api_key = key
    cfg.auth = f"a throwaway 'bench' user and API key in {relative(data_dir)}"
    cfg.our_env[DATA_DIR_ENV] = str(data_dir)
    print(f"[bench] ours: bench user and API key in {data_dir}", file=sys.stderr, flush=True)


@dataclass
class LevelRun:
    """Raw outcome of one concurrency level on one server start."""

    concurrency: int
    wall_s: float
    timings: list[RequestTiming]
    staggered: bool = False


def pool_runs(runs: Sequence[LevelRun], staggered: bool = False) -> list[LevelStats]:
    """Per level (in first-seen order), every round's requests together; tok/s over the
    summed wall time of that level's rounds. Steady runs only, or staggered ones only."""
    by_level: dict[int, list[LevelRun]] = {}
    for run in runs:
        if run.staggered == staggered:
            by_level.setdefault(run.concurrency, []).append(run)
    return [
        summarize_level(
            level, [t for run in group for t in run.timings], sum(run.wall_s for run in group)
        )
        for level, group in by_level.items()
    ]


def stagger_comparison(runs: Sequence[LevelRun]) -> list[dict[str, Any]]:
    """Per level run both ways: running streams' ITL p95 with clients all at once (steady)
    and staggered, and staggered/steady (the goal: at most 1.5)."""
    steady = {s.concurrency: s for s in pool_runs(runs)}
    rows = []
    for s in pool_runs(runs, staggered=True):
        base = steady.get(s.concurrency)
        rows.append({"concurrency": s.concurrency,
                     "itl_p95_steady_s": base.itl_p95_s if base else None,
                     "itl_p95_staggered_s": s.itl_p95_s, "itl_max_staggered_s": s.itl_max_s,
                     "ratio": safe_ratio(s.itl_p95_s, base.itl_p95_s if base else None),
                     "errors": s.errors})
    return rows


def round_order(servers: Sequence[str], round_index: int) -> list[str]:
    """A B, then B A, ...: drift on a noisy machine hits both servers alike over 2 rounds."""
    return list(servers) if round_index % 2 == 0 else list(reversed(servers))


def combine_flags(values: Sequence[bool | None]) -> bool | None:
    """All true → True; any false → False; otherwise (unchecked somewhere) None."""
    if any(v is False for v in values):
        return False
    return True if values and all(v is True for v in values) else None


def log_path(cfg: Config, name: str, round_index: int) -> Path:
    suffix = "" if cfg.rounds == 1 else f"-round{round_index + 1}"
    return cfg.output_dir / f"{name}{suffix}.log"


async def bench_one_server(
    name: str, cfg: Config, round_index: int, runs: list[LevelRun]
) -> dict[str, Any]:
    """Start one server, warm it up, run every level (appending to `runs`), stop it."""
    port = free_port(HOST)
    log = log_path(cfg, name, round_index)
    server = (make_ranked_server(name, cfg, port, log) if cfg.ranks > 1
              else make_server(name, cfg, port, log))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    info: dict[str, Any] = {
        "round": round_index + 1,
        "command": display_command(server.argv),
        "log": relative(server.log_path),
        "env_overrides": {k: v for k, v in sorted(server.env.items()) if os.environ.get(k) != v},
        "error": None,
    }
    print(f"[bench] starting {name}: {info['command']}", file=sys.stderr, flush=True)
    try:
        with running(server):
            await drive_server(name, cfg, server, port, headers, info, runs)
    except (ServerStartError, RuntimeError, httpx.HTTPError, OSError) as exc:
        print(f"[bench] {name} failed: {exc}", file=sys.stderr, flush=True)
        info["error"] = str(exc)
    info["exit_code"] = server.proc.returncode if server.proc else None
    if isinstance(server, ServerGroup):
        info["ranks"] = server.rank_facts()
    return info


async def drive_server(
    name: str,
    cfg: Config,
    server: Server,
    port: int,
    headers: dict[str, str],
    info: dict[str, Any],
    runs: list[LevelRun],
) -> None:
    base_url = f"http://{HOST}:{port}"
    info["health"] = await wait_ready(server, base_url, headers, cfg.ready_timeout_s)
    info["pid"] = server.pid
    info.update(blas_facts(server))
    # mlx_lm loads another model when "model" names anything but the one it was started
    # with; "default_model" is its own name for that one.
    model = (
        "default_model"
        if name == MLX_LM
        else await discover_model(Target(name, base_url, headers, None))
    )
    info["request_model"] = model
    target = Target(name=name, base_url=base_url, headers=headers, model=model)
    if cfg.workload.warmup:
        await warm_up(target, cfg.workload)
    offset = 0
    for concurrency in cfg.workload.concurrency:
        stats, timings = await run_level(target, cfg.workload, concurrency, offset)
        offset += concurrency * cfg.workload.requests_per_client
        runs.append(LevelRun(concurrency, stats.wall_s, timings))
        if cfg.workload.stagger_ms > 0 and concurrency > 1:
            stats, timings = await run_level(target, cfg.workload, concurrency, offset,
                                             cfg.workload.stagger_ms / 1000)
            offset += concurrency * cfg.workload.requests_per_client
            runs.append(LevelRun(concurrency, stats.wall_s, timings, staggered=True))
        print(
            f"[bench] {name} C={concurrency}: {fmt_rate(stats.tokens_per_s)} tok/s, "
            f"TTFT p95 {fmt_ms(stats.ttft_p95_s)} ms, ITL p95 {fmt_ms(stats.itl_p95_s)} ms, "
            f"{stats.errors} errors",
            file=sys.stderr,
            flush=True,
        )
    # after every level, the server still up: what serving these clients held (rank 0's)
    info["memory"] = resident(server.pid)


def server_result(starts: Sequence[dict[str, Any]], runs: Sequence[LevelRun]) -> dict[str, Any]:
    """One server's JSON: pooled levels, per-start facts, per-request summaries."""
    errors = [s["error"] for s in starts if s["error"]]
    return {
        "command": starts[0]["command"],
        "log": ", ".join(s["log"] for s in starts),
        "ranks": starts[0].get("ranks"),
        "openblas_loaded": combine_flags([s.get("openblas_loaded") for s in starts]),
        "skinny_matmul_loaded": combine_flags([s.get("skinny_matmul_loaded") for s in starts]),
        "error": "; ".join(errors) or None,
        "resident_bytes": max((m["rss"] for s in starts if (m := s.get("memory"))), default=None),
        "resident_peak_bytes": max((m["peak"] for s in starts if (m := s.get("memory"))),
                                   default=None),
        "levels": [asdict(stats) for stats in pool_runs(runs)],
        "staggered": stagger_comparison(runs),
        "starts": list(starts),
        "requests": [
            dict(t.summary(), concurrency=run.concurrency, staggered=run.staggered)
            for run in runs for t in run.timings
        ],
    }


async def bench_all(cfg: Config) -> dict[str, dict[str, Any]]:
    """Every round, every server, one server at a time."""
    starts: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.servers}
    runs: dict[str, list[LevelRun]] = {name: [] for name in cfg.servers}
    for round_index in range(cfg.rounds):
        for name in round_order(cfg.servers, round_index):
            if any(start["error"] for start in starts[name]):
                continue  # it failed once; do not spend another round on it
            starts[name].append(await bench_one_server(name, cfg, round_index, runs[name]))
    return {name: server_result(starts[name], runs[name]) for name in cfg.servers}


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def package_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for dist, key in (("mlx", "mlx"), ("mlx-lm", "mlx_lm"), ("appliance", "appliance")):
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def build_report(
    cfg: Config, servers: dict[str, dict[str, Any]], started: dt.datetime
) -> dict[str, Any]:
    stats = {name: [LevelStats(**lv) for lv in s["levels"]] for name, s in servers.items()}
    ratios = compute_ratios(stats[OURS], stats[MLX_LM]) if OURS in stats and MLX_LM in stats else []
    llama = compute_ratios(stats[OURS], stats[LLAMA_CPP]) if {OURS, LLAMA_CPP} <= set(stats) else []
    meta = {
        "date": started.isoformat(timespec="seconds"),
        "command": cfg.command,
        "model": model_facts(cfg.model_dir) if cfg.model_dir else {"path": str(cfg.gguf)},
        "gguf": str(cfg.gguf) if cfg.gguf else None,
        "blas": cfg.blas,
        "blas_report": blas_report(cfg.blas, servers),
        "git_commit": git_commit(REPO_ROOT),
        "versions": package_versions(),
        "machine": machine_description(),
        "concurrency": cfg.workload.concurrency,
        "requests_per_client": cfg.workload.requests_per_client,
        "max_tokens": cfg.workload.max_tokens,
        "prompt_words": cfg.workload.prompt_words,
        "stagger_ms": cfg.workload.stagger_ms,
        "quote": cfg.workload.quote,
        "max_batch_size": cfg.max_batch_size,
        "ranks": cfg.ranks,
        "pinned": cfg.pin and cfg.ranks > 1,
        "rounds": cfg.rounds,
        "auth": cfg.auth,
        "server_order": [round_order(cfg.servers, r) for r in range(cfg.rounds)],
        "include_usage": cfg.workload.include_usage,
        "output_dir": str(cfg.output_dir),
        "duration_s": round((dt.datetime.now(dt.UTC) - started).total_seconds(), 1),
    }
    return {"meta": meta, "servers": servers, "ratios": [asdict(r) for r in ratios],
            f"ratios_{LLAMA_CPP}": [asdict(r) for r in llama]}


def machine_description() -> str:
    return f"{platform.system()} {platform.machine()}, {_cpu_count()} CPUs"


def _cpu_count() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    )


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------


def positive_ints(text: str, error: str) -> list[int]:
    """A comma-separated list of positive integers; anything else is argparse's ``error``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(error)
    return values


def parse_levels(text: str) -> list[int]:
    return positive_ints(text, "concurrency levels must be positive integers, e.g. 1,2,4,8")


def parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--our-env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Benchmark our server against mlx_lm.server on the same model and "
        "llama.cpp's server on the same GGUF, same run.",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"model directory (default: build {DEFAULT_MODEL_SHAPE} into "
        f"{DEFAULT_MODEL_DIR}, cached)",
    )
    p.add_argument(
        "--servers",
        default=f"{OURS},{MLX_LM}",
        help="comma-separated servers to run, in order: ours, mlx_lm, llama_cpp "
        "(default: ours,mlx_lm)",
    )
    p.add_argument(
        "--gguf", type=Path, default=None,
        help="the GGUF file llama_cpp serves (the one --model was imported from)",
    )
    p.add_argument(
        "--llama-cmd", default=None,
        help="command of llama.cpp's server; -m/--host/--port/-np/-t/-c are appended "
        f"(default: ${llama_cpp.BINARY_ENV}, else what bench/peers/build-llama-server.sh built)",
    )
    p.add_argument(
        "--llama-threads", type=int, default=2,
        help="llama-server's -t (default: 2)",
    )
    p.add_argument(
        "--ranks", type=int, default=1,
        help="run ours and mlx_lm each on this many ranks of this machine (ring backend on "
        "127.0.0.1; mlx_lm with --pipeline, ours with serve --distributed and join); "
        "without --model, a Qwen 2-shaped model (default: 1)",
    )
    p.add_argument(
        "--no-pin", action="store_true",
        help="with --ranks > 1, do not pin each rank to a core of its own (taskset -c)",
    )
    p.add_argument(
        "--join-cmd",
        default=f"{shlex.quote(sys.executable)} -m appliance join",
        help="command prefix of our follower ranks; HOSTFILE --rank R --model DIR are appended",
    )
    p.add_argument(
        "--concurrency",
        type=parse_levels,
        default=[1, 2, 4, 8],
        help="concurrent client counts (default: 1,2,4,8)",
    )
    p.add_argument(
        "-n",
        "--requests-per-client",
        type=int,
        default=4,
        help="requests each client sends back to back per level (default: 4)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the whole comparison, alternating the server order (A B, B A, ...) and "
        "pooling the requests; 2 cancels most drift of a noisy machine (default: 1)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=64, help="max_tokens per request (default: 64)"
    )
    p.add_argument(
        "--prompt-words", type=int, default=0,
        help="filler words appended to each question, for longer prompts (default: 0)",
    )
    p.add_argument(
        "--quote", action="store_true",
        help="each request asks for a text to be repeated word for word (what prompt "
        "lookup's drafts are for) instead of a question",
    )
    p.add_argument(
        "--stagger-ms", type=float, default=0.0,
        help="also run every level with its clients starting MS ms apart, and report the "
        "running streams' ITL p95 against the steady run (default: 0, steady only)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="our --max-batch-size, mlx_lm's --decode/--prompt-concurrency and "
        "llama-server's -np "
        "(default: the highest concurrency level)",
    )
    p.add_argument(
        "--blas",
        choices=("openblas", "bundled"),
        default=None,
        help="preload Debian's OpenBLAS into both servers, or use mlx's bundled BLAS "
        "(default: openblas when installed)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="sent as 'Authorization: Bearer KEY' to both servers (mlx_lm ignores it)",
    )
    p.add_argument(
        "--our-cmd",
        default=f"{shlex.quote(sys.executable)} -m appliance serve",
        help="command prefix of our server; --model/--host/--port/--max-batch-size are appended",
    )
    p.add_argument(
        "--no-provision",
        action="store_true",
        help="without --api-key, ours normally gets a throwaway data dir (under the output "
        "dir) with a 'bench' user and key; this flag skips that",
    )
    p.add_argument(
        "--our-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for our server (repeatable)",
    )
    p.add_argument(
        "--mlx-cmd",
        default=f"{shlex.quote(sys.executable)} -m mlx_lm server",
        help="command prefix of mlx_lm.server",
    )
    p.add_argument(
        "--no-usage",
        action="store_true",
        help="do not ask for stream_options.include_usage; count text chunks instead",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up requests")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="per-request read timeout in seconds (default: 600)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for GET /health (default: 300)",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help=f"where server logs and the report go (default: {DEFAULT_OUTPUT_ROOT}/<time>)",
    )
    summary.add_arguments(p)
    return p


def resolve_model(model: Path | None) -> Path:
    """The model directory; build (once, cached) the SmolLM-135M-shaped one when absent."""
    if model is not None:
        if not (model / "config.json").exists():
            raise SystemExit(f"--model {model}: no config.json there")
        return model.resolve()
    if (DEFAULT_MODEL_DIR / "config.json").exists():
        return DEFAULT_MODEL_DIR.resolve()
    from appliance.demo.build import build_model

    print(
        f"[bench] building {DEFAULT_MODEL_SHAPE} into {DEFAULT_MODEL_DIR} (once)...",
        file=sys.stderr,
        flush=True,
    )
    return build_model(DEFAULT_MODEL_DIR, shape=DEFAULT_MODEL_SHAPE).resolve()


def resolve_ranked_model(model: Path | None, servers: Sequence[str]) -> Path:
    """The model of a run on several ranks: one mlx_lm can pipeline, with the weight
    index its ``sharded_load`` reads (written when missing). Without --model, the default
    model as Qwen 2 (built once, cached)."""
    from bench import qwen2_model

    if model is None:
        if not (DEFAULT_RANKS_MODEL_DIR / "config.json").exists():
            print(f"[bench] writing the Qwen 2 twin of the default model into "
                  f"{DEFAULT_RANKS_MODEL_DIR} (once)...", file=sys.stderr, flush=True)
            qwen2_model.convert(resolve_model(None), DEFAULT_RANKS_MODEL_DIR)
        return DEFAULT_RANKS_MODEL_DIR.resolve()
    model = resolve_model(model)
    model_type = str(json.loads((model / "config.json").read_text()).get("model_type"))
    if MLX_LM in servers and not rank_setup.pipelines(model_type):
        raise SystemExit(
            f"--ranks: mlx_lm cannot pipeline a {model_type} model; write its Qwen 2 twin "
            f"with python -m bench.qwen2_model {relative(model)} OUT")
    if (model / qwen2_model.WEIGHTS).exists() and qwen2_model.write_index(model):
        print(f"[bench] wrote {relative(model / qwen2_model.INDEX)} (mlx_lm's sharded_load "
              "reads it)", file=sys.stderr, flush=True)
    return model


def check_ranks(args: argparse.Namespace, servers: Sequence[str]) -> None:
    if args.ranks < 1:
        raise SystemExit("--ranks must be at least 1")
    if args.ranks > 1 and LLAMA_CPP in servers:
        raise SystemExit(f"--ranks {args.ranks}: {LLAMA_CPP} runs on one rank only")


def config_from_args(args: argparse.Namespace, command: str, started: dt.datetime) -> Config:
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(servers) - set(SERVER_NAMES))
    if unknown or not servers:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {', '.join(SERVER_NAMES)}")
    check_ranks(args, servers)
    if min(args.requests_per_client, args.max_tokens, args.rounds) < 1:
        raise SystemExit("--requests-per-client, --max-tokens and --rounds must be at least 1")
    if args.stagger_ms < 0:
        raise SystemExit("--stagger-ms must not be negative")
    blas = args.blas or default_blas()
    if blas == "openblas" and not OPENBLAS_PATH.exists():
        raise SystemExit(
            f"--blas openblas: {OPENBLAS_PATH} not found (apt-get install libopenblas0-pthread)"
        )
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    gguf, llama_cmd = llama_from_args(args, servers)
    model_dir = None
    if {OURS, MLX_LM} & set(servers):
        model_dir = (resolve_ranked_model(args.model, servers) if args.ranks > 1
                     else resolve_model(args.model))
    return Config(
        model_dir=model_dir,
        servers=servers,
        workload=Workload(
            concurrency=args.concurrency,
            requests_per_client=args.requests_per_client,
            max_tokens=args.max_tokens,
            include_usage=not args.no_usage,
            warmup=not args.no_warmup,
            request_timeout_s=args.request_timeout,
            prompt_words=args.prompt_words,
            stagger_ms=args.stagger_ms,
            quote=args.quote,
        ),
        max_batch_size=args.max_batch_size or max(args.concurrency),
        blas=blas,
        api_key=args.api_key,
        our_cmd=shlex.split(args.our_cmd),
        our_env=parse_env(args.our_env),
        mlx_cmd=shlex.split(args.mlx_cmd),
        output_dir=(args.output_dir or DEFAULT_OUTPUT_ROOT / stamp).resolve(),
        ready_timeout_s=args.ready_timeout,
        command=command,
        rounds=args.rounds,
        auth="--api-key" if args.api_key else "none",
        gguf=gguf,
        llama_cmd=llama_cmd,
        llama_threads=args.llama_threads,
        ranks=args.ranks,
        pin=not args.no_pin,
        join_cmd=shlex.split(args.join_cmd),
    )


def llama_from_args(args: argparse.Namespace, servers: Sequence[str]
                    ) -> tuple[Path | None, list[str]]:
    """The GGUF file and llama-server command, checked before anything starts."""
    if LLAMA_CPP not in servers:
        return None, []
    if args.gguf is None or not args.gguf.is_file():
        raise SystemExit(f"--servers {LLAMA_CPP} needs --gguf FILE (got {args.gguf})")
    if args.llama_cmd:
        return args.gguf.resolve(), shlex.split(args.llama_cmd)
    binary = llama_cpp.default_binary()
    if not binary.exists():
        raise SystemExit(llama_cpp.missing_binary_message(binary))
    return args.gguf.resolve(), [str(binary)]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the Markdown report; 0 when every server ran without errors."""
    prog = "python -m bench.serve"
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(args_list)
    started = dt.datetime.now(dt.UTC)
    cfg = config_from_args(args, shlex.join([*shlex.split(prog), *args_list]), started)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_provision:
        apply_provisioning(cfg)
    servers = run_guarded(bench_all(cfg), cfg.output_dir)
    if servers is None:
        return 130
    report = build_report(cfg, servers, started)
    write_report(cfg.output_dir, render_report(report), report, "serve", args)
    failed = any(
        s.get("error") or any(lv["errors"] for lv in s["levels"]) for s in servers.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
