"""Rank 0 forms the group and watches it (the engine thread forms it; threads of its own
watch it).

At start rank 0 listens on the control port and waits ``join_timeout`` for every other
machine's ``hello``; it checks their version and model, splits the layers by their memory
budgets (appliance/distributed/stage.py), sends each its part, and all of them join
MLX's ring. When a machine does not come, rank 0 serves the whole model alone if it fits
its own budget (``/health`` says degraded), and otherwise gives up (the daemon exits and
its service manager starts it again). Once serving, a machine that closes its connection,
misses its beats for ``heartbeat_timeout`` or leaves a forward unanswered for
``step_timeout`` loses the group (:meth:`Link.lose`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from appliance import __version__
from appliance.distributed import control
from appliance.distributed.control import BEAT_S, COMPUTE, Channel, ChannelClosed
from appliance.distributed.hostfile import Hostfile
from appliance.distributed.link import Link, RankInfo
from appliance.engine.model import hidden_dtype
from appliance.settings import DistributedSettings

log = logging.getLogger(__name__)

HEADROOM = 1 << 30
LOST_FILE = "distributed-lost.json"
"""In the data folder: why the machines were last parted, until they serve together again."""


def fingerprint(model_dir: Path) -> str:
    """What two machines compare to know they hold the same model: the config and each
    weight file's name and size (reading every byte of the weights would take minutes)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def memory_budget(setting: int) -> int:
    if setting:
        return setting
    import psutil

    return max(int(psutil.virtual_memory().available) - HEADROOM, 0)


def init_ring(rank: int, hostfile: Path, timeout: float) -> Any:
    """Join MLX's ring group as ``rank`` (its init blocks until every rank connects, so it
    runs on a thread of its own and is given up on after ``timeout``)."""
    import mlx.core as mx

    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(mx.distributed.init(strict=True, backend="ring"))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="ring-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if errors:
        raise RuntimeError(f"joining MLX's ring failed: {errors[0]}")
    if not out:
        raise RuntimeError(f"the machines did not connect over MLX's ring within {timeout:.0f} s")
    return out[0]


def layer_bytes(model: Any) -> tuple[list[int], int]:
    """Each layer's weight bytes and the rest's (embedding, norm, head), from the shapes
    (the weights need not be loaded), as each machine will hold them once its load has
    adapted them to the backend (widened, tiled)."""
    from appliance.backend.plug import held_bytes

    layers = [held_bytes(model, layer) for layer in model.model.layers]
    return layers, held_bytes(model, model) - sum(layers)


class Coordinator:
    """Rank 0's side of the group: the control channels, the split, the watchers."""

    def __init__(self, hostfile: Hostfile, settings: DistributedSettings, model_dir: Path,
                 engine_flags: dict[str, Any], state_dir: Path | None = None) -> None:
        """``state_dir``: where the reason the group was last lost is kept (the data
        folder) until the machines serve together again."""
        self.hostfile = hostfile
        self.settings = settings
        self.model_dir = model_dir
        self.engine_flags = engine_flags
        self.fingerprint = fingerprint(model_dir)
        self.budget = memory_budget(settings.memory_budget)
        self.channels: dict[int, Channel] = {}
        self.hellos: dict[int, dict[str, Any]] = {}
        self.alone: str | None = None
        """Why rank 0 serves alone (None: the group serves)."""
        self.returned: str | None = None
        """Alone: which machine has come back since (the daemon restarts, when idle, to
        serve with it)."""
        self.link: Link | None = None
        self.ranks: list[RankInfo] = []
        self._lost_file = None if state_dir is None else state_dir / LOST_FILE
        self.parted = self._parted()
        """Why the machines were last parted (when, and the reason), kept across the
        restart the loss causes until they serve together again; None: they were not."""
        self._stop = threading.Event()
        self._server = control.listen(hostfile.hosts[0], settings.control_port)
        log.info("distributed: waiting for %d machines on %s:%d", hostfile.size - 1,
                 hostfile.hosts[0], settings.control_port)

    # ---- start (engine thread) ----
    def split(self, model: Any) -> tuple[int, int] | None:
        """Wait for the others, split the layers and join the ring: this machine's layers
        ``(lo, hi)``, or None to serve the whole model alone. Raises when neither works."""
        from appliance.distributed.split import split_layers
        from appliance.engine.batch import plain_kv
        from appliance.engine.mixed import supports_mixed

        if not (supports_mixed(model) and plain_kv(model)):
            self._refuse_all("this model's architecture cannot be split across machines")
            raise RuntimeError(
                f"{type(model).__module__.rsplit('.', 1)[-1]} models cannot be served across "
                "machines: only those whose decode step rides prompt chunks can "
                "(docs/distributed.md)")
        layers, edges = layer_bytes(model)
        self._gather(time.monotonic() + self.settings.join_timeout)
        missing = [r for r in range(1, self.hostfile.size) if r not in self.channels]
        if missing:
            whole = sum(layers) + edges
            what = ", ".join(f"machine {r} ({self.hostfile.hosts[r]})" for r in missing)
            if whole > self.budget:
                raise RuntimeError(
                    f"{what} did not join within {self.settings.join_timeout:.0f} s and the "
                    f"model ({whole >> 20} MiB) does not fit this machine's budget "
                    f"({self.budget >> 20} MiB)")
            self.alone = (f"{what} did not join within {self.settings.join_timeout:.0f} s: "
                          "serving on this machine alone")
            if self.parted is not None:
                self.alone += f" (the machines were parted {self.parted})"
            log.warning("distributed: %s", self.alone)
            self._close_channels()
            threading.Thread(target=self._await_return, name="group-return",
                             daemon=True).start()
            return None
        budgets = [self.budget] + [int(self.hellos[r]["memory_budget"])
                                   for r in range(1, self.hostfile.size)]
        try:
            spans = split_layers(layers, edges, budgets)
        except ValueError as exc:
            self._refuse_all(str(exc))
            raise RuntimeError(str(exc)) from exc
        hidden = int(model.args.hidden_size)
        for r, ch in self.channels.items():
            span = spans[r]
            ch.send({"welcome": {"layers": [span.lo, span.hi], "size": self.hostfile.size,
                                 "hidden": hidden,
                                 "step_timeout": self.settings.step_timeout,
                                 **self.engine_flags}})
        self.ranks = [RankInfo(s.rank, self.hostfile.hosts[s.rank], (s.lo, s.hi))
                      for s in spans]
        log.info("distributed: layers split %s", " ".join(
            f"machine{s.rank}=[{s.lo},{s.hi})" for s in spans))
        self.group = init_ring(0, self.hostfile.path, self.settings.join_timeout)
        return spans[0].lo, spans[0].hi

    def _await_return(self) -> None:
        """Alone: a machine of the hostfile that says hello (with the right model) is asked
        to retry, and the daemon restarts at its next idle moment to serve with it
        (``Engine.check``); one that does not fit is refused as at start."""
        while not self._stop.is_set():
            try:
                ch = control.accept(self._server, 1.0)
            except OSError:  # closed: the daemon is stopping
                return
            if ch is None:
                continue
            try:
                hello = ch.receive(5.0).get("hello")
            except ChannelClosed:
                ch.close()
                continue
            problem = self._check(hello)
            if problem is not None:
                _refuse(ch, problem)
                continue
            assert isinstance(hello, dict)
            rank = int(hello["rank"])
            if self.returned is None:
                self.returned = f"machine {rank} ({self.hostfile.hosts[rank]})"
                log.warning("distributed: %s is back; restarting to serve on both machines "
                            "when idle", self.returned)
            with contextlib.suppress(ChannelClosed):
                ch.send({"retry": "rank 0 restarts to serve with this machine when idle"})
            ch.close()

    def _parted(self) -> str | None:
        """The kept reason of the last loss, with its time (None: none kept)."""
        if self._lost_file is None:
            return None
        try:
            kept = json.loads(self._lost_file.read_text())
            return f"at {kept['at']}: {kept['reason']}"
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _remember(self, reason: str) -> None:
        """Keep why the group was lost: the daemon restarts at once, and ``/health`` says
        it until the machines serve together again (issue 52)."""
        if self._lost_file is not None:
            at = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            tmp = self._lost_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"reason": reason, "at": at}))
            tmp.replace(self._lost_file)

    def _forget(self) -> None:
        self.parted = None
        if self._lost_file is not None:
            self._lost_file.unlink(missing_ok=True)

    def _refuse_all(self, why: str) -> None:
        self._gather(time.monotonic() + 0.1)  # whoever is already waiting hears why
        for ch in self.channels.values():
            _refuse(ch, why)
        self.channels = {}

    def _gather(self, deadline: float) -> None:
        while len(self.channels) < self.hostfile.size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ch = control.accept(self._server, left)
            if ch is None:
                return
            try:
                hello = ch.receive(max(deadline - time.monotonic(), 1.0)).get("hello")
            except ChannelClosed:
                ch.close()
                continue
            problem = self._check(hello)
            if problem is not None:
                log.error("distributed: refused a machine: %s", problem)
                _refuse(ch, problem)
                continue
            assert isinstance(hello, dict)
            rank = int(hello["rank"])
            old = self.channels.pop(rank, None)
            if old is not None:
                old.close()
            self.channels[rank] = ch
            self.hellos[rank] = hello
            log.info("distributed: machine %d joined (budget %d MiB)", rank,
                     int(hello["memory_budget"]) >> 20)

    def _check(self, hello: Any) -> str | None:
        if not isinstance(hello, dict):
            return "it did not say hello"
        rank = hello.get("rank")
        if not isinstance(rank, int) or not 1 <= rank < self.hostfile.size:
            return f"rank {rank!r} is not one of 1..{self.hostfile.size - 1} in the hostfile"
        if hello.get("version") != __version__:
            return (f"machine {rank} runs appliance {hello.get('version')}, this one "
                    f"{__version__}: install the same version on both")
        if hello.get("model") != self.fingerprint:
            return (f"machine {rank}'s model {hello.get('model_name')!r} is not this "
                    f"machine's {self.model_dir.name!r} (fingerprints differ): copy the same "
                    "model directory to both")
        if not isinstance(hello.get("memory_budget"), int):
            return f"machine {rank} gave no memory budget"
        return None

    def start(self, model: Any, weight_bytes: int = 0) -> Link | None:
        """After this machine's layers are loaded (``weight_bytes``, as adopted): wait
        until the others have loaded theirs, then watch the group. The link the engine
        runs through (None: alone)."""
        if self.alone is not None:
            return None
        import mlx.core as mx

        from appliance.distributed.stage import Stage, attach

        for r, ch in self.channels.items():
            try:
                ready = ch.receive(600.0).get("ready")
            except ChannelClosed as exc:
                raise RuntimeError(f"machine {r} failed before it was ready: {exc}") from exc
            if not isinstance(ready, dict):
                raise RuntimeError(f"machine {r} failed to load its layers: "
                                   f"{ready if ready is not None else 'no reason given'}")
            self.ranks[r].weight_bytes = int(ready.get("weight_bytes", 0))
        # The hidden states' dtype only now: loading adapts the model to the backend (on
        # the CPU a quantized model's 16-bit embedding computes in float32), and a follower
        # told the unadapted dtype read float32 bytes as float16 (issue 52).
        dtype = hidden_dtype(model)
        for r, ch in self.channels.items():
            try:
                ch.send({"go": {"dtype": str(dtype).removeprefix("mlx.core.")}})
            except ChannelClosed as exc:
                raise RuntimeError(f"machine {r} failed before it served: {exc}") from exc
        total = mx.distributed.all_sum(mx.array(1), group=self.group)
        if int(total.tolist()) != self.hostfile.size:  # type: ignore[arg-type]
            raise RuntimeError("the ring's first sum is wrong: the group is not whole")
        self.ranks[0].weight_bytes = weight_bytes
        link = Link(self.group, self.ranks,
                    [self.channels[r] for r in range(1, self.hostfile.size)],
                    self.settings.step_timeout)
        attach(model, Stage(self.group, int(model.args.hidden_size), dtype, link))
        link.remember = self._remember
        self.link = link
        self._forget()
        for r, ch in self.channels.items():
            threading.Thread(target=self._listen, args=(r, ch), name=f"rank{r}-control",
                             daemon=True).start()
        threading.Thread(target=self._watch, name="group-watch", daemon=True).start()
        log.info("distributed: serving across %d machines", self.hostfile.size)
        return link

    # ---- watching (threads of their own) ----
    def _listen(self, rank: int, ch: Channel) -> None:
        info = self.ranks[rank]
        while not self._stop.is_set():
            try:
                msg = ch.receive(self.settings.heartbeat_timeout)
            except ChannelClosed as exc:
                if not self._stop.is_set() and self.link is not None:
                    self.link.lose(f"machine {rank} ({info.host}) lost: {exc}")
                return
            info.seen = time.monotonic()
            beat = msg.get("beat")
            if isinstance(beat, dict):
                info.steps = int(beat.get("steps", info.steps))
                info.step_ms = float(beat.get("step_ms", info.step_ms))
                info.kv_bytes = int(beat.get("kv_bytes", info.kv_bytes))
                info.rss_bytes = int(beat.get("rss_bytes", info.rss_bytes))
                info.computing = beat.get("phase") == COMPUTE
                if not info.computing:
                    info.waiting_since = info.seen - float(beat.get("phase_s", 0.0))
            pong = msg.get("pong")
            if isinstance(pong, float):
                info.link_ms = (time.perf_counter() - pong) * 1000

    def _watch(self) -> None:
        told = -1
        while not self._stop.wait(BEAT_S):
            link = self.link
            if link is None or link.lost is not None:
                return
            now = time.monotonic()
            late = link.overdue(now)
            if late is not None:
                # A machine that still beats and computes is slow, not lost (8-10 s prompt
                # steps on a busy box, issue 52): only a forward every machine has waited on
                # for step_timeout is a hang; a silent one is lost by its missed beats.
                busy = [r for r in self.ranks[1:] if r.computing
                        or now - r.waiting_since <= link.step_timeout]
                if not busy:
                    link.lose(f"a forward waited {late:.1f} s on the other machines "
                              f"(step_timeout {link.step_timeout:g} s)")
                    return
                if told != link.step:
                    told = link.step
                    log.warning("distributed: a forward has waited %.1f s on machine %s, "
                                "which still computes and beats: waiting", late,
                                ", ".join(str(r.rank) for r in busy))
            for r, ch in list(self.channels.items()):
                try:
                    ch.send({"ping": time.perf_counter()})
                except ChannelClosed as exc:
                    link.lose(f"machine {r} ({self.hostfile.hosts[r]}) lost: {exc}")
                    return

    def status(self) -> dict[str, Any]:
        if self.ranks:
            import psutil

            self.ranks[0].rss_bytes = int(psutil.Process().memory_info().rss)
        return {"machines": self.hostfile.size, "alone": self.alone, "returned": self.returned,
                "lost": self.parted if self.link is None else self.link.lost,
                "ranks": [r.as_dict() for r in self.ranks]}

    def close(self) -> None:
        """Tell the others rank 0 stops (they exit cleanly) and close the channels."""
        self._stop.set()
        if self.link is not None:
            self.link.stop()
        self._close_channels()
        with contextlib.suppress(OSError):
            self._server.close()

    def _close_channels(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self.channels = {} if self.link is None else self.channels


def _refuse(ch: Channel, why: str) -> None:
    with contextlib.suppress(ChannelClosed):
        ch.send({"refuse": why})
    ch.close()
