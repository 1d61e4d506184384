"""`python -m bench.fairness`: our server under `--policy fcfs` and `--policy fair`, same run.

For each policy a fresh server (the real MLX engine, on 127.0.0.1, with its own copy of a
throwaway data dir holding the personas' users and keys) runs these phases one after another:

1. ``solo-light``: bob alone, short chats one at a time with think-time gaps (baseline).
2. ``solo-voice``: dave alone, short voice-class requests one at a time (baseline).
3. ``heavy-light``: alice keeps K long streaming requests in flight (long prompts, long
   outputs) while bob chats as in 1. → bob's TTFT relative to his solo TTFT.
4. ``backlogged``: alice keeps twice the batch size of long requests in flight and bob M
   short ones, so that both always have a request waiting even when one of them fills the
   whole batch → service difference per window between the two backlogged users, as in
   the VTC paper (Sheng et al., OSDI 2024).
5. ``voice-background``: carol keeps more background-class requests in flight than the
   batch holds while dave sends voice requests as in 2. → voice TTFT relative to solo.
6. ``weighted``: alice (weight 1) and erin (weight 4) each keep twice the batch size of
   equal requests in flight → erin's service over alice's, 4 when weights hold. Twice, not
   once: with exactly the batch in flight, a user whose answers reach the client late has
   nothing queued when her slots free (docs/decisions/weighted-shares.md).

Output tokens/s over the loaded phases (3-5) compares the throughput of the two policies.
Prompt and output lengths are drawn per request from seeded generators (the same sequence
under both policies), and end-of-sequence tokens get a logit bias of -100 so that every
request writes exactly its ``max_tokens``: both policies get the same work. Service is attributed in time from what the client sees:
prompt tokens computed (``prompt_tokens - cached_tokens`` of the usage chunk) at the first
text chunk, output tokens spread over the text chunks; a user is backlogged at a moment when
one of their requests was sent and has not produced its first text chunk yet.

Run: ``python -m bench.fairness [--model DIR|demo|smollm-135m] [--summary PATH]``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.vocab import Klass
from bench import ranks as rank_setup
from bench.chat_load import Target, Workload, chat_payload, discover_model, warm_up
from bench.client import stream_chat
from bench.fairness_config import (
    PERSONAS,
    REPO_ROOT,
    Config,
    Lane,
    PhaseSpec,
    PromptMaker,
    build_parser,
    config_from_args,
    describe_workload,
    eos_token_ids,
    phase_specs,
    run_order,
    token_counter,
)
from bench.fairness_report import render_report
from bench.fairness_stats import (
    BACKGROUND,
    HEAVY,
    VOICE,
    Goal,
    PolicySummary,
    Record,
    evaluate_goals,
    pool_solo,
    summarize_policy,
)
from bench.process import (
    ServerGroup,
    ServerProcess,
    ServerStartError,
    blas_facts,
    blas_report,
    free_port,
    run_guarded,
    running,
    server_env,
    server_group,
    wait_ready,
)
from bench.provision import DATA_DIR_ENV, provision
from bench.report import (
    display_command,
    git_commit,
    model_facts,
    relative,
)
from bench.serve import package_versions
from bench.summary import write_report

HOST = "127.0.0.1"
CLASS_HEADER = "x-appliance-class"

START_SPREAD_S = 2.0
"""The slots of a multi-request lane start at random within this many seconds."""


# --------------------------------------------------------------------------------------
# driving one server
# --------------------------------------------------------------------------------------


@dataclass
class PhaseRun:
    spec: PhaseSpec
    targets: Mapping[str, Target]
    prompts: PromptMaker
    logit_bias: Mapping[str, float]
    seed: int
    t0: float = 0.0
    deadline: float | None = None
    records: list[Record] = field(default_factory=list)


async def lane_slot(run: PhaseRun, client: httpx.AsyncClient, lane: Lane, slot: int) -> None:
    """One request of a lane in flight at a time, back to back (after the think time)."""
    target = run.targets[lane.user]
    url = f"{target.base_url}/v1/chat/completions"
    rng = random.Random(f"{run.seed}:{run.spec.name}:{lane.user}:{slot}")
    if lane.concurrency > 1:  # a user's parallel requests do not all start (and end) together
        await asyncio.sleep(rng.uniform(0.0, START_SPREAD_S))
    for index in itertools.count():
        if lane.requests is not None and index >= lane.requests:
            return
        if run.deadline is not None and time.perf_counter() >= run.deadline:
            return
        payload = chat_payload(target, run.prompts.make(lane.shape.prompt_tokens, rng),
                               rng.randint(*lane.shape.max_tokens), include_usage=True)
        if run.logit_bias:
            payload["logit_bias"] = dict(run.logit_bias)
        sent = time.perf_counter() - run.t0
        timing = await stream_chat(client, url, payload, target.headers, client_id=slot,
                                   index=index)
        run.records.append(Record(lane.user, slot, sent, timing))
        pause = rng.uniform(*lane.think_s)
        await asyncio.sleep(pause if timing.ok else max(pause, 1.0))


async def run_phase(run: PhaseRun, request_timeout_s: float, drain_timeout_s: float) -> int:
    """Run every lane of the phase; returns how many requests were cut off at the drain
    timeout (their records are lost)."""
    slots = [(lane, i) for lane in run.spec.lanes for i in range(lane.concurrency)]
    limits = httpx.Limits(max_connections=len(slots) + 4, max_keepalive_connections=len(slots))
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        run.t0 = time.perf_counter()
        if run.spec.duration_s is not None:
            run.deadline = run.t0 + run.spec.duration_s
        tasks = [asyncio.create_task(lane_slot(run, client, lane, i)) for lane, i in slots]
        wait = None if run.spec.duration_s is None else run.spec.duration_s + drain_timeout_s
        _, pending = await asyncio.wait(tasks, timeout=wait)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return len(pending)


def server_argv(cfg: Config, policy: str, port: int) -> list[str]:
    argv = [*cfg.our_cmd, "--model", str(cfg.model_dir), "--host", HOST, "--port", str(port),
            "--max-batch-size", str(cfg.max_batch_size), "--policy", policy]
    if policy == "fair":
        argv += cfg.fair_flags
    return [*argv, *cfg.server_args]


def make_server(cfg: Config, policy: str, run: str, port: int, data_dir: Path
                ) -> ServerProcess | ServerGroup:
    env = server_env(cfg.blas)
    env["APPLIANCE_BLAS"] = cfg.blas  # our CLI would preload OpenBLAS on its own otherwise
    env[DATA_DIR_ENV] = str(data_dir)
    log_path = cfg.output_dir / f"{run}.log"
    if cfg.ranks > 1:  # rank 0 serves as ever; the others join (bench.ranks)
        plan = rank_setup.plan_ranks(cfg.ranks, log_path.with_name(f"{run}-hostfile.json"),
                                     True, HOST)
        argvs = [[*server_argv(cfg, policy, port), "--distributed", str(plan.hostfile),
                  "--control-port", str(plan.control_port)]]
        argvs += [rank_setup.our_follower_argv(cfg.join_cmd, cfg.model_dir, plan.hostfile, r,
                                               plan.control_port)
                  for r in range(1, cfg.ranks)]
        followers = {**env, DATA_DIR_ENV: str(data_dir / "follower")}
        return server_group(f"ours --policy {policy}",
                            [rank_setup.pinned(a, plan.core(r)) for r, a in enumerate(argvs)],
                            [env] + [followers] * (cfg.ranks - 1), log_path)
    return ServerProcess(name=f"ours --policy {policy}", argv=server_argv(cfg, policy, port),
                         env=env, log_path=log_path)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def bench_policy(cfg: Config, policy: str, run: str, keys: Mapping[str, str],
                       template: Path, prompts: PromptMaker, bias: Mapping[str, float]
                       ) -> dict[str, Any]:
    """Start a server with this policy on a fresh copy of the data dir, run every phase,
    stop it. The raw records of each phase go into the returned JSON-able dict. ``run``:
    the run's name (the policy's, and its round's number with ``--rounds``)."""
    data_dir = cfg.output_dir / f"data-{run}"
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.copytree(template, data_dir)
    port = free_port(HOST)
    server = make_server(cfg, policy, run, port, data_dir)
    info: dict[str, Any] = {"policy": policy, "command": display_command(server.argv),
                            "log": relative(server.log_path),
                            "error": None, "phases": {}, "cut_off": {}}
    log(f"starting {run}: {info['command']}")
    try:
        with running(server):
            await drive(cfg, run, server, port, keys, prompts, bias, info)
    except (ServerStartError, RuntimeError, httpx.HTTPError, OSError) as exc:
        log(f"{run} failed: {exc}")
        info["error"] = str(exc)
    info["exit_code"] = server.proc.returncode if server.proc else None
    return info


async def drive(cfg: Config, name: str, server: ServerProcess | ServerGroup, port: int,
                keys: Mapping[str, str], prompts: PromptMaker, bias: Mapping[str, float],
                info: dict[str, Any]) -> None:
    base_url = f"http://{HOST}:{port}"
    auth = {"Authorization": f"Bearer {keys[HEAVY]}"}
    info["health"] = await wait_ready(server, base_url, auth, cfg.ready_timeout_s)
    info.update(blas_facts(server))
    model = await discover_model(Target(HEAVY, base_url, auth, None))
    targets = user_targets(base_url, keys, model)
    await warm_up(targets[HEAVY], Workload([cfg.max_batch_size], 1, 8, True, True,
                                           cfg.request_timeout_s))
    for spec in phase_specs(cfg):
        if spec.name not in cfg.phases:
            continue
        if server.exited() is not None:
            raise RuntimeError(f"server exited with code {server.exited()}; log "
                               f"{server.log_path}:\n{server.log_tail()}")
        phase = PhaseRun(spec, targets, prompts, bias, cfg.seed)
        cut = await run_phase(phase, cfg.request_timeout_s, cfg.drain_timeout_s)
        info["phases"][spec.name] = phase.records
        info["cut_off"][spec.name] = cut
        failed = sum(1 for r in phase.records if not r.timing.ok)
        log(f"{name} {spec.name}: {len(phase.records)} requests, {failed} failed, "
            f"{cut} cut off")


def user_targets(base_url: str, keys: Mapping[str, str], model: str | None
                 ) -> dict[str, Target]:
    klass = {BACKGROUND: Klass.BACKGROUND.label, VOICE: Klass.VOICE.label}
    targets = {}
    for user, key in keys.items():
        headers = {"Authorization": f"Bearer {key}"}
        if user in klass:
            headers[CLASS_HEADER] = klass[user]
        targets[user] = Target(user, base_url, headers, model)
    return targets


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def summarize_all(cfg: Config, servers: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, PolicySummary]:
    """One summary per policy, over its rounds (``servers``: every run by name)."""
    spans = {spec.name: spec.window() for spec in phase_specs(cfg)}
    solo = pool_solo([info["phases"] for info in servers.values()])
    summaries = {}
    for policy in cfg.policies:
        runs = {name: info for name, info in servers.items() if info["policy"] == policy}
        errors = [f"{name}: {info['error']}" for name, info in runs.items() if info["error"]]
        summaries[policy] = summarize_policy(
            policy, [info["phases"] for info in runs.values()], spans, cfg.window_s, cfg.windows,
            cfg.w_in, cfg.w_out, error="; ".join(errors) or None, solo=solo)
    return summaries


def build_meta(cfg: Config, servers: Mapping[str, Mapping[str, Any]], started: dt.datetime
               ) -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": started.isoformat(timespec="seconds"),
        "command": cfg.command,
        "model": model_facts(cfg.model_dir),
        "blas": cfg.blas,
        "blas_report": blas_report(cfg.blas, servers),
        "git_commit": git_commit(REPO_ROOT),
        "versions": package_versions(),
        "machine": f"{platform.system()} {platform.machine()}, {cpus} CPUs",
        "max_batch_size": cfg.max_batch_size,
        "rounds": cfg.rounds,
        "w_in": cfg.w_in,
        "w_out": cfg.w_out,
        "window_s": cfg.window_s,
        "windows": cfg.windows,
        "workload": describe_workload(cfg),
        "output_dir": str(cfg.output_dir),
        "duration_s": round((dt.datetime.now(dt.UTC) - started).total_seconds(), 1),
    }


def report_json(meta: Mapping[str, Any], summaries: Mapping[str, PolicySummary],
                goals: Sequence[Goal], servers: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, Any]:
    raw = {
        policy: {**{k: v for k, v in info.items() if k != "phases"},
                 "phases": {name: [r.to_json() for r in recs]
                            for name, recs in info["phases"].items()}}
        for policy, info in servers.items()
    }
    return {
        "meta": dict(meta),
        "summaries": {p: asdict(s) for p, s in summaries.items()},
        "goals": [dict(asdict(g), met=g.met) for g in goals],
        "servers": raw,
    }


async def bench_all(cfg: Config, keys: Mapping[str, str], template: Path
                    ) -> dict[str, dict[str, Any]]:
    prompts = PromptMaker(token_counter(cfg.model_dir))
    bias = {str(i): -100.0 for i in eos_token_ids(cfg.model_dir)} if cfg.eos_bias else {}
    return {run: await bench_policy(cfg, policy, run, keys, template, prompts, bias)
            for policy, run in run_order(cfg.policies, cfg.rounds)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the Markdown report; 0 when every server ran cleanly."""
    prog = "python -m bench.fairness"
    args_list = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(args_list)
    started = dt.datetime.now(dt.UTC)
    cfg = config_from_args(args, shlex.join([*shlex.split(prog), *args_list]), started)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    template = cfg.output_dir / "data-template"
    log(f"provisioning users {', '.join(p.name for p in PERSONAS)} in {template}")
    try:
        keys = provision(template, PERSONAS, server_env(cfg.blas))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log(f"could not provision the users: {exc}")
        return 1
    servers = run_guarded(bench_all(cfg, keys, template), cfg.output_dir)
    if servers is None:
        return 130
    summaries = summarize_all(cfg, servers)
    goals = evaluate_goals(summaries)
    meta = build_meta(cfg, servers, started)
    write_report(cfg.output_dir, render_report(meta, summaries, goals, servers),
                 report_json(meta, summaries, goals, servers), "fairness", args)
    failed = any(s.error or s.request_errors for s in summaries.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
