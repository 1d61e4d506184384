"""Synthetic workloads for the simulator, and the table it prints.

Scenarios (persona names as in the tests):

* ``heavy-light``: bob runs a document script, 8 requests in flight with 2-4k token
  prompts; alice's script sends short ones, 12 in flight. Both keep the server busy, so both are
  backlogged: fcfs serves them by request count (bob gets most of the tokens), fair by
  weighted tokens.
* ``voice-background``: carol's voice assistant (Poisson, short), alice chatting hard
  enough to fill the batch on her own, and bob's background summaries. fcfs (strict class
  order) starves background; fair ages it and keeps the background reserve.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.percentiles import percentile
from appliance.sched.simulator import Arrival, Loop, RequestResult, SimResult, Simulator
from appliance.sched.types import SchedulerConfig
from appliance.vocab import Klass


@dataclass(frozen=True, slots=True)
class Workload:
    arrivals: tuple[Arrival, ...] = ()
    loops: tuple[Loop, ...] = ()


def poisson(user: str, klass: Klass, rate: float, duration: float, prompt: tuple[int, int],
            output: tuple[int, int], rng: random.Random) -> list[Arrival]:
    """Open-loop arrivals at ``rate`` per second for ``duration`` seconds."""
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(Arrival(t, user, klass, rng.randint(*prompt), rng.randint(*output)))
        t += rng.expovariate(rate)
    return out


def heavy_light(seed: int, duration: float) -> Workload:
    return Workload(loops=(
        Loop("bob", Klass.INTERACTIVE, 8, (2000, 4000), (200, 400), stop=duration, seed=seed),
        Loop("alice", Klass.INTERACTIVE, 12, (100, 400), (50, 150), stop=duration,
             seed=seed + 1),
    ))


def voice_background(seed: int, duration: float) -> Workload:
    rng = random.Random(seed)
    return Workload(
        arrivals=tuple(poisson("carol", Klass.VOICE, 0.25, duration, (80, 200), (10, 40), rng)),
        loops=(
            Loop("alice", Klass.INTERACTIVE, 16, (300, 1500), (100, 300), think_s=0.5,
                 stop=duration, seed=seed + 1),
            Loop("bob", Klass.BACKGROUND, 4, (2000, 4000), (200, 400), stop=duration,
                 seed=seed + 2),
        ))


SCENARIOS: dict[str, Callable[[int, float], Workload]] = {
    "heavy-light": heavy_light,
    "voice-background": voice_background,
}


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(res: SimResult) -> str:
    """Per-user results: completions, refusals, TTFT and wait percentiles, service share."""
    users = sorted({r.user for r in res.requests} | {a.user for a, _ in res.refused})
    total = sum(res.served[-1].values()) or 1.0
    lines = [f"{'user':<6} {'class':<11} {'done':>5} {'refused':>7} {'wait p50':>8} "
             f"{'wait max':>8} {'ttft p50':>8} {'ttft p95':>8} {'served wtok':>12} {'share':>6}"]
    for user in users:
        mine: list[RequestResult] = [r for r in res.requests if r.user == user]
        done = [r for r in mine if r.reason.complete]
        waits = [r.started - r.arrival for r in mine if r.started is not None]
        ttfts = [t for r in done if (t := r.ttft) is not None]
        served = res.served[-1].get(user, 0.0)
        klass = "/".join(sorted({r.klass.label for r in mine})) or "-"
        lines.append(
            f"{user:<6} {klass:<11} {len(done):>5} "
            f"{sum(a.user == user for a, _ in res.refused):>7} "
            f"{_s(percentile(waits, 50)):>8} {_s(max(waits, default=None)):>8} "
            f"{_s(percentile(ttfts, 50)):>8} {_s(percentile(ttfts, 95)):>8} "
            f"{served:>12.0f} {served / total:>6.1%}")
    avg, top, n = res.service_difference(60.0)
    completed = sum(r.reason.complete for r in res.requests) or 1
    lines.append(f"service difference per 60 s window (backlogged users): avg {avg:.0f} "
                 f"max {top:.0f} over {n} windows")
    lines.append(f"preemptions per completed request: {res.preemptions / completed:.3f}; "
                 f"peak KV {res.peak_kv} tokens; ticks {res.ticks}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import time

    p = argparse.ArgumentParser(prog="python -m appliance.sched.workloads",
                                description="Run the real scheduler on a synthetic workload.")
    p.add_argument("--policy", default="fair", choices=("fair", "fcfs"))
    p.add_argument("--scenario", default="heavy-light", choices=sorted(SCENARIOS))
    p.add_argument("--duration", type=float, default=900.0, help="simulated seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--kv-budget-tokens", type=int, default=None)
    p.add_argument("--enable-preemption", action="store_true")
    p.add_argument("--preemption-policy", default="fair",
                   choices=("fair", "longest-first", "lowest-priority"))
    args = p.parse_args(argv)
    config = SchedulerConfig(max_batch_size=args.max_batch_size, policy=args.policy,
                             kv_budget_tokens=args.kv_budget_tokens,
                             enable_preemption=args.enable_preemption,
                             preemption_policy=args.preemption_policy)
    work = SCENARIOS[args.scenario](args.seed, args.duration)
    t0 = time.perf_counter()
    res = Simulator(config).run(work.arrivals, work.loops)
    wall = time.perf_counter() - t0
    print(f"policy={args.policy} scenario={args.scenario} requests={len(res.requests)} "
          f"simulated={res.times[-1]:.0f}s wall={wall:.1f}s")
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
