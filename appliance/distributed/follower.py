"""``appliance join``: a machine that runs later layers of rank 0's model (MLX).

It connects to rank 0's control port (again and again until rank 0 answers), says hello,
gets its layers, loads only those, joins MLX's ring and then runs every forward rank 0
plans (appliance/distributed/plan.py) on its own copy of the decode batch and of the
sequences' caches, which therefore stay the same as rank 0's. It computes no logits and
samples nothing. Exit status: 0 when rank 0 stopped cleanly; :data:`GROUP_LOST_EXIT` when
the group was lost (the service manager starts it again and it waits for rank 0);
:data:`REFUSED_EXIT` when rank 0 refused it (a different model or version).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import __version__
from appliance.distributed import control, plan
from appliance.distributed.control import BEAT_S, COMPUTE, IDLE, RING, Channel, ChannelClosed
from appliance.distributed.group import fingerprint, init_ring, memory_budget
from appliance.distributed.hostfile import Hostfile
from appliance.settings import Settings

if TYPE_CHECKING:
    from appliance.distributed.stage import Stage

log = logging.getLogger(__name__)

GROUP_LOST_EXIT = 75
"""EX_TEMPFAIL: the group was lost; start again and wait for rank 0."""
REFUSED_EXIT = 78
"""EX_CONFIG: rank 0 refused this machine; restarting will not help until it is fixed."""


def connect(hostfile: Hostfile, port: int) -> Channel:
    """Rank 0's control channel, retried every second until it answers."""
    said = 0.0
    while True:
        try:
            return control.connect(hostfile.hosts[0], port)
        except OSError as exc:
            if time.monotonic() - said > 10:
                log.info("waiting for rank 0 at %s:%d (%s)", hostfile.hosts[0], port,
                         exc.strerror or exc)
                said = time.monotonic()
            time.sleep(1.0)


class Replica:
    """This machine's copy of rank 0's decode batch and sequence caches."""

    def __init__(self, model: Any, max_rows: int) -> None:
        from appliance.engine.batch import DecodeBatch

        self.model = model
        self.max_rows = max_rows
        self.batch = DecodeBatch(model, max_rows)
        self.caches: dict[int, list[Any]] = {}
        self.steps = 0
        self.step_ms = 0.0

    @property
    def kv_bytes(self) -> int:
        from appliance.engine.batch import cache_nbytes

        return self.batch.nbytes + sum(cache_nbytes(c) for c in self.caches.values())

    def apply(self, ops: list[Any]) -> bool:
        """Run one plan; False when rank 0 said stop."""
        from appliance.engine.batch import DecodeBatch

        for op in ops:
            kind = op[0]
            if kind == "join":
                try:
                    entries: list[tuple[list[int], list[Any], list[int] | None]] = [
                        ([rid], self.caches.pop(rid), None) for rid in op[1]]
                except KeyError as exc:
                    raise plan.PlanError(f"sequence {exc} joins but has no cache here") from exc
                self.batch.join(entries)
            elif kind == "remove":
                self.batch.remove(set(op[1]))
            elif kind == "expect":
                self.batch.expect(*op[1:])
            elif kind == "reset":
                self.batch = DecodeBatch(self.model, self.max_rows)
            elif kind == "forward":
                self._forward(op[1], op[2], set(op[3]))
            elif kind == "stop":
                return False
            else:
                raise plan.PlanError(f"unknown operation {kind!r}")
        return True

    def _forward(self, rows: int, chunks: list[list[int]], live: set[int]) -> None:
        import mlx.core as mx

        from appliance.engine.batch import new_sequence_cache
        from appliance.engine.mixed import mixed_step

        start = time.perf_counter()
        if rows and rows != len(self.batch):  # 0: the chunks alone, whatever the batch holds
            raise plan.PlanError(f"a forward of {rows} rows, this batch has {len(self.batch)}")
        parts = []
        for rid, at, n in chunks:
            if at == 0:
                self.caches[rid] = new_sequence_cache(self.model)
            cache = self.caches.get(rid)
            if cache is None or cache[0].offset != at:
                raise plan.PlanError(f"sequence {rid}'s chunk starts at {at}, its cache here "
                                     f"at {None if cache is None else cache[0].offset}")
            parts.append((cache, [0] * n, False))
        if rows and parts:
            self.batch.step_mixed([0] * rows, parts)
        elif rows:
            mx.eval(self.batch.step([0] * rows))
        else:
            out, _ = mixed_step(self.model, None, [], parts)
            mx.eval(out)
        for rid in [r for r in self.caches if r not in live]:
            del self.caches[rid]
        self.steps += 1
        self.step_ms = (time.perf_counter() - start) * 1000


def _exit(rc: int) -> None:
    logging.shutdown()
    os._exit(rc)


def _beat(ch: Channel, replica: Replica, stage: Stage, step_timeout: float) -> None:
    """Report every :data:`BEAT_S`, with what the main thread does and for how long (rank
    0 keeps waiting on a machine that computes, however slowly); leave at once when a ring
    operation has waited on the other machines past ``step_timeout`` (the main thread is
    then stuck in one that may never return)."""
    import psutil

    proc = psutil.Process()
    while True:
        phase, waited = stage.phase, time.monotonic() - stage.since
        if phase == RING and waited > step_timeout:
            log.critical("a forward waited %.1f s on the other machines; leaving", waited)
            _exit(GROUP_LOST_EXIT)
        try:
            ch.send({"beat": {"steps": replica.steps, "step_ms": replica.step_ms,
                              "phase": phase, "phase_s": round(waited, 3),
                              "kv_bytes": replica.kv_bytes,
                              "rss_bytes": proc.memory_info().rss}})
        except ChannelClosed:
            return
        time.sleep(BEAT_S)


def join(settings: Settings, hostfile: Hostfile, rank: int, model_dir: Path) -> int:
    """Serve as ``rank`` until the group ends; the exit status."""
    from appliance.engine.model import load_model

    if not 1 <= rank < hostfile.size:
        raise ValueError(f"rank {rank} is not one of 1..{hostfile.size - 1} in {hostfile.path}")
    dist = settings.distributed
    budget = memory_budget(dist.memory_budget)
    hello = {"hello": {"rank": rank, "version": __version__, "model": fingerprint(model_dir),
                       "model_name": model_dir.name, "memory_budget": budget}}
    while True:
        ch = connect(hostfile, dist.control_port)
        ch.send(hello)
        try:
            msg = ch.receive(dist.join_timeout * 3 + 60)
        except ChannelClosed as exc:
            log.error("rank 0 did not answer: %s", exc)
            return GROUP_LOST_EXIT
        if "retry" not in msg:
            break
        log.info("rank 0 serves alone and restarts to take this machine in when idle")
        ch.close()
        time.sleep(2.0)
    if "refuse" in msg:
        log.error("rank 0 refused this machine: %s", msg["refuse"])
        time.sleep(5)  # a service manager restarting it at once would spin
        return REFUSED_EXIT
    welcome = msg.get("welcome")
    if not isinstance(welcome, dict):
        log.error("rank 0 answered with no welcome")
        return GROUP_LOST_EXIT
    lo, hi = welcome["layers"]
    log.info("distributed: machine %d of %d runs layers [%d, %d)", rank, welcome["size"], lo, hi)
    group = init_ring(rank, hostfile.path, dist.join_timeout * 3 + 60)
    try:
        loaded = load_model(model_dir, native=bool(welcome.get("native", True)),
                            fast_cpu_ops=bool(welcome.get("fast_cpu_ops", True)),
                            layers=(lo, hi), edges=False)
    except Exception as exc:
        log.exception("loading layers [%d, %d) failed", lo, hi)
        ch.send({"ready": f"loading failed: {type(exc).__name__}: {exc}"})
        return GROUP_LOST_EXIT
    import mlx.core as mx

    from appliance.distributed.stage import Stage, attach

    replica = Replica(loaded.model, int(welcome.get("max_rows", 8)))
    ch.send({"ready": {"weight_bytes": loaded.weight_bytes}})
    try:  # rank 0 says the hidden states' dtype once its own load has adapted its model
        go = ch.receive(dist.join_timeout * 3 + 600).get("go")
    except ChannelClosed as exc:
        log.critical("rank 0 lost before serving: %s", exc)
        return GROUP_LOST_EXIT
    if not isinstance(go, dict):
        log.error("rank 0 answered with no go")
        return GROUP_LOST_EXIT
    stage = Stage(group, int(welcome["hidden"]), getattr(mx, str(go["dtype"])))
    attach(loaded.model, stage)
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group))
    threading.Thread(target=_beat, args=(ch, replica, stage, float(welcome["step_timeout"])),
                     name="beat", daemon=True).start()
    log.info("distributed: machine %d serving", rank)
    return _serve(ch, replica, stage, dist.heartbeat_timeout)


def _serve(ch: Channel, replica: Replica, stage: Stage, timeout: float) -> int:
    """Run rank 0's plans as they come. Rank 0 pings every :data:`BEAT_S`, so ``timeout``
    seconds of silence mean it is gone."""
    plans: queue.SimpleQueue[dict[str, Any] | ChannelClosed] = queue.SimpleQueue()
    threading.Thread(target=_read, args=(ch, plans, timeout), name="control-read",
                     daemon=True).start()
    step = 0
    try:
        while True:
            msg = plans.get()
            if isinstance(msg, ChannelClosed):
                raise msg
            ops = plan.decode(msg, step)
            step += 1
            stage.enter(COMPUTE)
            if not replica.apply(ops):
                log.info("rank 0 stopped; leaving")
                return 0
            stage.enter(IDLE)
    except ChannelClosed as exc:
        log.critical("rank 0 lost: %s", exc)
    except plan.PlanError as exc:
        log.critical("the group disagrees: %s", exc)
    except Exception as exc:
        log.critical("the group was lost: %s", type(exc).__name__, exc_info=True)
    return GROUP_LOST_EXIT


def _read(ch: Channel, plans: queue.SimpleQueue[dict[str, Any] | ChannelClosed],
          timeout: float) -> None:
    """Answer pings at once (the link's round trip, not this machine's forwards) and queue
    the plans for the main thread."""
    while True:
        try:
            msg = ch.receive(timeout)
            if "ping" in msg:
                ch.send({"pong": msg["ping"]})
                continue
        except ChannelClosed as exc:
            plans.put(exc)
            return
        plans.put(msg)
