"""Benchmark: the engine's aggregate throughput with open dashboards versus none, same run.

    python -m bench.dashboards [--model DIR|tiny] [--dashboards 5] [--clients 8]
                                   [--rounds 10] [--phase-s 6] [--stream] [--summary FILE.json]

One server in this process (engine thread + event loop, as the daemon runs). A load process
keeps ``--clients`` chat requests in flight the whole time (``--stream``: streamed). Phases alternate in
ABBA order (none, open, open, none, ...); during an "open" phase a viewer process keeps
``--dashboards`` admin dashboards connected to ``/dashboard/stream`` (reconnecting as a
browser does). Throughput is the engine's own generated-token counter over each phase.
Clients live in other processes so only the server's cost of the dashboards is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench import summary
from bench.provision import BenchUser, add_users

SETTLE_S = 1.5
"""After opening or closing the dashboards, wait this long before measuring."""


# ---- the load and viewer processes (HTTP only) ----
def run_load(url: str, key: str, clients: int, max_tokens: int, ban: list[int],
             stream: bool) -> None:
    """Keep ``clients`` chat completions in flight until killed."""
    def client(n: int) -> None:
        i = 0
        with httpx.Client(base_url=url, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as c:
            while True:
                i += 1
                body = {"messages": [{"role": "user", "content": f"Story {n}-{i}, please."}],
                        "max_tokens": max_tokens, "stream": stream, "temperature": 0,
                        "logit_bias": {str(t): -100 for t in ban}}
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_viewers(url: str, key: str, dashboards: int, seconds: float) -> None:
    """Keep ``dashboards`` dashboard streams open for ``seconds``; print what they got."""
    deadline = time.monotonic() + seconds
    counts = [0] * dashboards
    connections = [0] * dashboards

    def viewer(n: int) -> None:
        with httpx.Client(base_url=url, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as c:
            while time.monotonic() < deadline:
                connections[n] += 1
                with c.stream("GET", "/dashboard/stream") as r:
                    for line in r.iter_lines():
                        counts[n] += line.startswith("event:")
                        if time.monotonic() >= deadline:
                            return
    threads = [threading.Thread(target=viewer, args=(n,)) for n in range(dashboards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"events": sum(counts), "connections": sum(connections)}), flush=True)


# ---- the server and the measurement ----
def _server(model: Path, batch: int) -> tuple[Any, Any, dict[str, str], str, Any, int]:
    """Engine, app, API keys, URL, a stop function and the event loop's thread id, wired
    exactly as the daemon is (``build_daemon``)."""
    from appliance.daemon import build_daemon, serve_in_thread
    from appliance.settings import Settings

    settings = Settings()
    settings.engine.model = str(model)
    settings.engine.max_batch_size = batch
    settings.store.data_dir = tempfile.mkdtemp(prefix="appliance-bench-")
    daemon = build_daemon(settings, secret="b" * 32, drain_timeout=1)
    plain = add_users(daemon.store, [BenchUser("bench-admin", role="admin", key_name="bench-admin"),
                                     BenchUser("bench-load", key_name="bench-load")])
    served = serve_in_thread(daemon)
    return (daemon.engine, daemon.app, plain, served.url, served.stop,
            int(served.thread.native_id or 0))


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.dashboards", *args],
                            stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])


def _hub_busy(app: Any) -> float:
    """Seconds the dashboards' frames have cost so far: rendering on the event loop plus
    the worker thread's CPU reading the service table for them."""
    web = app.state.get("web")
    return 0.0 if web is None else float(web.hub.busy_s + web.hub.table_cpu_s)


def _thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) the thread has used so far."""
    import psutil
    return next((t.user_time + t.system_time for t in psutil.Process().threads()
                 if t.id == native_id), 0.0)


def _process_cpu(pids: list[int]) -> float:
    """CPU seconds the processes have used so far (gone ones count 0)."""
    import psutil
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _measure(engine: Any, app: Any, loop_thread: int, seconds: float, clients: list[int]
             ) -> tuple[float, float, float, float]:
    """Generated tokens per second; the share of one core the dashboard frames took (render
    and service-table reads); the
    share of one core the whole event loop used (HTTP, SSE sends, frames); and the share
    of one core the benchmark's own client processes used (the load and the viewers, which
    share this machine's cores with the engine: in a home they are other devices)."""
    start_t, start_n, start_b, start_c, start_p = (
        time.monotonic(), engine.snapshot.generated_tokens_total, _hub_busy(app),
        _thread_cpu(loop_thread), _process_cpu(clients))
    time.sleep(seconds)
    took = time.monotonic() - start_t
    return ((engine.snapshot.generated_tokens_total - start_n) / took,
            (_hub_busy(app) - start_b) / took, (_thread_cpu(loop_thread) - start_c) / took,
            (_process_cpu(clients) - start_p) / took)


def paired(phases: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean and 95% half-width of the per-round change (open vs none in the same round);
    ABBA order cancels a steady drift between rounds."""
    by_round: dict[int, dict[int, float]] = {}
    for p in phases:
        by_round.setdefault(p["round"], {})[p["dashboards"] > 0] = p["tokens_per_s"]
    changes = [100.0 * (r[True] - r[False]) / r[False] for r in by_round.values()
               if len(r) == 2 and r[False]]
    if len(changes) < 2:
        return (changes[0] if changes else 0.0), float("nan")
    half = 1.96 * statistics.stdev(changes) / len(changes) ** 0.5
    return statistics.mean(changes), half


def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = _model(args.model)
    engine, app, keys, url, stop, loop_thread = _server(model, args.batch)
    ban = list(engine.loaded.eos_token_ids if engine.loaded else [])
    load = _spawn("--role", "load", "--url", url, "--key", keys["bench-load"], "--clients",
                  str(args.clients), "--max-tokens", str(args.max_tokens),
                  "--ban", ",".join(map(str, ban)), *(["--stream"] if args.stream else []))
    phases: list[dict[str, Any]] = []
    try:
        time.sleep(args.warmup_s)
        for r in range(args.rounds):
            for kind in (("none", "open") if r % 2 == 0 else ("open", "none")):
                viewers = None
                if kind == "open":
                    viewers = _spawn("--role", "viewers", "--url", url, "--key",
                                     keys["bench-admin"], "--dashboards", str(args.dashboards),
                                     "--seconds", str(args.phase_s + SETTLE_S))
                time.sleep(SETTLE_S)
                clients = [load.pid] + ([viewers.pid] if viewers is not None else [])
                rate, busy, loop, client = _measure(engine, app, loop_thread, args.phase_s,
                                                    clients)
                phase: dict[str, Any] = {"round": r, "dashboards": args.dashboards
                                         if kind == "open" else 0, "tokens_per_s": rate,
                                         "frame_cpu_share": busy, "loop_cpu_share": loop,
                                         "client_cpu_share": client}
                if viewers is not None:
                    out, _ = viewers.communicate(timeout=60)
                    phase.update(json.loads(out.strip().splitlines()[-1]))
                phases.append(phase)
                print(f"  round {r} {kind:>4}: {rate:8.1f} tok/s, loop {100 * loop:4.1f}%, "
                      f"clients {100 * client:4.1f}%"
                      + (f"  ({phase['events']} dashboard events)" if viewers else ""),
                      flush=True)
    finally:
        load.kill()
        load.wait()
        stop()
    none = [p["tokens_per_s"] for p in phases if p["dashboards"] == 0]
    open_ = [p["tokens_per_s"] for p in phases if p["dashboards"] > 0]
    base, with_dash = statistics.mean(none), statistics.mean(open_)
    change, half = paired(phases)
    return {"model": str(model), "clients": args.clients, "batch": args.batch,
            "dashboards": args.dashboards, "phase_s": args.phase_s, "phases": phases,
            "cpus": os.cpu_count(), "tokens_per_s_none": base, "tokens_per_s_open": with_dash,
            "stdev_none": statistics.stdev(none) if len(none) > 1 else 0.0,
            "stdev_open": statistics.stdev(open_) if len(open_) > 1 else 0.0,
            "difference_pct": 100.0 * (with_dash - base) / base if base else None,
            "paired_difference_pct": change, "paired_ci95_pct": half,
            "frame_cpu_share_open": statistics.mean(
                p["frame_cpu_share"] for p in phases if p["dashboards"] > 0),
            "loop_cpu_share_none": statistics.mean(
                p["loop_cpu_share"] for p in phases if p["dashboards"] == 0),
            "loop_cpu_share_open": statistics.mean(
                p["loop_cpu_share"] for p in phases if p["dashboards"] > 0),
            "client_cpu_share_none": statistics.mean(
                p["client_cpu_share"] for p in phases if p["dashboards"] == 0),
            "client_cpu_share_open": statistics.mean(
                p["client_cpu_share"] for p in phases if p["dashboards"] > 0)}


def _model(choice: str) -> Path:
    if choice == "tiny":  # random weights, built like the test fixture (imports MLX)
        from appliance.demo.build import build_model
        return Path(build_model(Path(tempfile.mkdtemp()) / "tiny", shape="tiny"))
    if choice:
        return Path(choice)
    from appliance.engine.model import DEMO_MODEL_DIR
    return Path(DEMO_MODEL_DIR)


def _openblas(argv: list[str]) -> None:
    """Run with the BLAS libraries ``appliance serve`` preloads (Linux: skinny_matmul and
    Debian's OpenBLAS; appliance.backend.blas)."""
    from appliance.backend.blas import preload_env
    env = preload_env("auto", True)
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "bench.dashboards", *argv],
                  env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.dashboards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model directory, 'tiny', or empty: the demo")
    p.add_argument("--dashboards", type=int, default=5)
    p.add_argument("--clients", type=int, default=8, help="requests kept in flight")
    p.add_argument("--batch", type=int, default=8, help="--max-batch-size of the server")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stream", action="store_true",
                   help="the load streams its answers (more HTTP work beside the engine)")
    p.add_argument("--rounds", type=int, default=10,
                   help="each round: one phase of each kind")
    p.add_argument("--phase-s", type=float, default=6.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--blas", choices=("auto", "bundled"), default="auto")
    summary.add_arguments(p)
    p.add_argument("--role", choices=("main", "load", "viewers"), default="main",
                   help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--ban", default="", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "load":
        run_load(args.url, args.key, args.clients, args.max_tokens,
                 [int(t) for t in args.ban.split(",") if t], args.stream)
        return 0
    if args.role == "viewers":
        run_viewers(args.url, args.key, args.dashboards, args.seconds)
        return 0
    if args.blas == "auto":
        _openblas(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = bench(args)
    print(f"engine throughput: {result['tokens_per_s_none']:.1f} tok/s with no dashboard, "
          f"{result['tokens_per_s_open']:.1f} tok/s with {args.dashboards} open: "
          f"{result['difference_pct']:+.2f}%; paired by round "
          f"{result['paired_difference_pct']:+.2f}% ± {result['paired_ci95_pct']:.2f}% "
          f"(95%; goal: within 2%)")
    extra = result["loop_cpu_share_open"] - result["loop_cpu_share_none"]
    print(f"server cost of {args.dashboards} dashboards: making frames (render + service-table reads) "
          f"{100 * result['frame_cpu_share_open']:.2f}% of one core; event loop "
          f"{100 * result['loop_cpu_share_none']:.1f}% -> "
          f"{100 * result['loop_cpu_share_open']:.1f}% of one core ({100 * extra:+.2f} points)")
    print(f"the benchmark's own clients (load, viewers) on this machine: "
          f"{100 * result['client_cpu_share_none']:.1f}% -> "
          f"{100 * result['client_cpu_share_open']:.1f}% of one core")
    summary.keep("dashboards", result, args.summary, args.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
