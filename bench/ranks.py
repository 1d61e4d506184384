"""One server on two ranks, on this machine: the ring hostfile, which core each rank is
pinned to, and each rank's command line and environment (``python -m bench.serve --ranks
2``; the processes themselves: :class:`bench.process.ServerGroup`).

- mlx_lm: every rank runs the same ``mlx_lm server --pipeline`` command; MLX's ring backend
  reads its rank and the hostfile from ``MLX_RANK`` and ``MLX_HOSTFILE`` (what
  ``mlx.launch --backend ring`` exports), and only rank 0 serves HTTP.
- ours: rank 0 is ``appliance serve --distributed HOSTFILE``, every other rank
  ``appliance join HOSTFILE --rank R --model DIR``; they meet on rank 0's control port
  (``--control-port``: the appliance's default is fixed, so the benchmark picks a free one
  and runs beside other daemons without a clash).

Each rank is pinned to a core of its own (``taskset -c``): on a shared CPU an unpinned
rank's collective waits on the scheduler (one scalar all_sum costs 73-95 µs pinned, up to
5 ms unpinned).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.process import ServerGroup, free_port, server_group
from bench.serve_stats import MLX_LM, OURS


def ring_hostfile(ports: Sequence[int], host: str = "127.0.0.1") -> list[list[str]]:
    """MLX's ring hostfile: one list of ``host:port`` per rank, rank 0 first."""
    if len(ports) < 2 or len(set(ports)) != len(ports):
        raise ValueError(f"a ring needs at least two distinct ports, got {list(ports)}")
    return [[f"{host}:{port}"] for port in ports]


def write_hostfile(path: Path, ports: Sequence[int], host: str = "127.0.0.1") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ring_hostfile(ports, host)) + "\n")
    return path


def rank_cores(ranks: int, available: Sequence[int]) -> list[int]:
    """The core of each rank: the lowest allowed cores in order, wrapping round when there
    are fewer cores than ranks."""
    cores = sorted(available)
    if not cores:
        raise ValueError("no CPU cores to pin to")
    return [cores[rank % len(cores)] for rank in range(ranks)]


def allowed_cores() -> list[int]:
    """The cores this process may run on (all of them where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pinned(argv: Sequence[str], core: int | None) -> list[str]:
    """``argv`` run on one core (``taskset -c CORE``), or as it is for None."""
    return list(argv) if core is None else ["taskset", "-c", str(core), *argv]


def mlx_rank_env(env: Mapping[str, str], rank: int, hostfile: Path) -> dict[str, str]:
    """The environment of mlx_lm's rank ``rank``: what ``mlx.launch --backend ring`` sets."""
    return {**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}


def mlx_lm_argv(mlx_cmd: Sequence[str], model: Path, host: str, port: int,
                batch: int) -> list[str]:
    """mlx_lm's server, pipelined over the ranks of its ring (the same line on every rank).
    It batches up to --decode-concurrency sequences and prefills up to --prompt-concurrency
    prompts together: both capped at our max batch size."""
    return [*mlx_cmd, "--model", str(model), "--host", host, "--port", str(port),
            "--decode-concurrency", str(batch), "--prompt-concurrency", str(batch),
            "--pipeline"]


def our_leader_argv(our_cmd: Sequence[str], model: Path, host: str, port: int, batch: int,
                    hostfile: Path, control_port: int) -> list[str]:
    """Our rank 0: the daemon as ever, serving HTTP, with the ring's hostfile."""
    return [*our_cmd, "--model", str(model), "--host", host, "--port", str(port),
            "--max-batch-size", str(batch), "--distributed", str(hostfile),
            "--control-port", str(control_port)]


def our_follower_argv(join_cmd: Sequence[str], model: Path, hostfile: Path, rank: int,
                      control_port: int) -> list[str]:
    """Our rank ``rank`` ≥ 1: ``appliance join`` on the same model directory."""
    if rank < 1:
        raise ValueError("rank 0 is the daemon itself, not a follower")
    return [*join_cmd, str(hostfile), "--rank", str(rank), "--model", str(model),
            "--control-port", str(control_port)]


def pipelines(model_type: str) -> bool:
    """Whether mlx_lm can split a ``model_type`` model into pipeline stages (its model
    class has ``pipeline()``: qwen2, qwen3_moe, deepseek_v3, ...; llama has not)."""
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        return False
    return any(hasattr(obj, "pipeline") and hasattr(obj, "pipeline_layers")
               for obj in vars(module).values() if isinstance(obj, type))


# --------------------------------------------------------------------------------------
# one start of a server on several ranks
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlan:
    """Where the ranks of one server start meet: ring ports, hostfile, control port, cores."""

    hostfile: Path
    ring_ports: list[int]
    control_port: int
    cores: list[int] | None
    """Core of each rank; None: not pinned."""

    @property
    def ranks(self) -> int:
        return len(self.ring_ports)

    def core(self, rank: int) -> int | None:
        return None if self.cores is None else self.cores[rank]

    def facts(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "hostfile": str(self.hostfile),
                "ring": ring_hostfile(self.ring_ports), "control_port": self.control_port,
                "cores": self.cores}


def plan_ranks(ranks: int, hostfile: Path, pin: bool, host: str = "127.0.0.1") -> RankPlan:
    """Free ports for the ring and our control channel (free a moment ago), the hostfile
    written, and each rank's core when pinning."""
    ports: list[int] = []
    while len(ports) < ranks + 1:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    write_hostfile(hostfile, ports[:ranks], host)
    return RankPlan(hostfile=hostfile, ring_ports=ports[:ranks], control_port=ports[ranks],
                    cores=rank_cores(ranks, allowed_cores()) if pin else None)


def mlx_lm_group(plan: RankPlan, mlx_cmd: Sequence[str], model: Path, host: str, port: int,
                 batch: int, env: Mapping[str, str], log: Path) -> ServerGroup:
    argv = mlx_lm_argv(mlx_cmd, model, host, port, batch)
    return server_group(MLX_LM, [pinned(argv, plan.core(r)) for r in range(plan.ranks)],
                        [mlx_rank_env(env, r, plan.hostfile) for r in range(plan.ranks)], log)


def ours_group(plan: RankPlan, our_cmd: Sequence[str], join_cmd: Sequence[str], model: Path,
               host: str, port: int, batch: int, env: Mapping[str, str],
               log: Path) -> ServerGroup:
    argvs = [our_leader_argv(our_cmd, model, host, port, batch, plan.hostfile,
                             plan.control_port)]
    argvs += [our_follower_argv(join_cmd, model, plan.hostfile, r, plan.control_port)
              for r in range(1, plan.ranks)]
    return server_group(OURS, [pinned(a, plan.core(r)) for r, a in enumerate(argvs)],
                        [dict(env) for _ in range(plan.ranks)], log)
