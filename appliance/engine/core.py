"""The engine thread: it loads the model, owns MLX and runs the tick loop.

Each tick: drain new requests and cancellations; ask the scheduler for a plan; run one
batched decode step for every decoding sequence and the plan's prefill chunks; hand each
token to its request's stream; finish sequences and free their KV; publish a snapshot for
the monitoring endpoints. With nothing queued or running the thread blocks until a request
arrives.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.engine.chat_template import ModelRefused
from appliance.engine.embed import Embedder, EmbedJob
from appliance.engine.model import LoadedModel, load_model
from appliance.engine.request import (
    Event,
    FaultHook,
    FinishEvent,
    GenerationRequest,
    GroupLost,
    RequestHandle,
    Usage,
    UserAccess,
)
from appliance.engine.snapshot import EngineSnapshot
from appliance.engine.ticks import Meter
from appliance.sched.scheduler import Scheduler
from appliance.sched.types import SchedulerConfig
from appliance.sched.usage import RollingUsage
from appliance.store.records import LedgerRecord
from appliance.vocab import FinishReason

if TYPE_CHECKING:
    from appliance.engine.runner import Runner

log = logging.getLogger(__name__)

class EngineBusy(RuntimeError):
    """The queue is full (HTTP 503)."""


class EngineStopping(RuntimeError):
    """The daemon is draining and admits nothing new (HTTP 503)."""


class ModelChanging(EngineStopping):
    """The served model is being changed (``switch_model``): retry in a moment (HTTP 503)."""

    def __init__(self, to: str) -> None:
        super().__init__(f"the model is being changed to {to}; retry in a moment")
        self.to = to


class UserBusy(RuntimeError):
    """The user already has their maximum number of requests in progress (HTTP 429)."""


class SwitchRefused(RuntimeError):
    """A model switch that cannot start (split across machines, another under way)."""


class EngineDown(RuntimeError):
    """The engine thread died or stalled: it serves nothing until the daemon restarts
    (HTTP 503; ``/health`` says why)."""


AUTO_HEADROOM = 1 << 30
GRAMMAR_CHECKS_KEPT = 64
AUTO_MIN = 64 << 20


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: Path
    ctx_size: int = 0
    fast_cpu_ops: bool = True
    """Attention and SwiGLU from appliance/backend/native/mlx_fast.cpp when MLX runs on the CPU."""
    native: bool = True
    """The appliance's native code where MLX runs on the CPU (appliance/backend)."""
    max_queue_depth: int = 32
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_cache_budget: int | str | None = None
    """Bytes, 'auto' (half of the memory available after loading, less 1 GiB) or None."""
    prompt_cache_entries: int = 0
    """Finished requests whose KV is kept for reuse (0: no prompt cache)."""
    stall_timeout_s: float = 120.0
    """Seconds without a finished tick, while requests wait, after which the engine is
    declared stalled (0: never)."""
    group: Any = None
    """The machines this engine serves its model with (appliance/distributed/group.py's
    Coordinator: ``split``, ``start``, ``status``, ``close``); None: this machine alone."""
    gather_s: float = 0.02
    """When requests arrive while nothing runs, the engine waits this long for another
    before it plans a tick, again after each further one, for at most GATHER_ROUNDS: requests
    sent together (a household's clients, a job's map) are then read in one tick and start
    together, instead of the first streaming while the rest are read beside it. 0: plan at
    once."""
    draft_tokens: int = 0
    """The most draft tokens a lone stream verifies a step by prompt lookup
    (appliance/engine/lookup.py); 0: none (the daemon's setting turns it on)."""


GATHER_ROUNDS = 5


def budget_bytes(setting: int | str | None, available: int) -> int | None:
    if setting == "auto":
        return max(available // 2 - AUTO_HEADROOM, AUTO_MIN)
    return setting if isinstance(setting, int) else None


class Engine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 fault: FaultHook | None = None,
                 on_finish: Callable[[LedgerRecord], None] | None = None,
                 on_counters: Callable[[dict[str, float]], None] | None = None,
                 meter: Meter | None = None) -> None:
        self.config = config
        self._meter = meter
        self._on_finish = on_finish
        self._on_counters = on_counters
        self._clock = clock
        self._fault = fault
        self.usage = RollingUsage()
        """Tokens per user in the rolling day (daily quotas); any thread may read it."""
        self.kv_budget_bytes: int | None = None
        self._live: dict[str, int] = {}
        self._grammar_checks: dict[str, str | None] = {}
        self._control: queue.SimpleQueue[Callable[[Runner], None]] = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        # rids submitted and not yet admitted: the queue depth back-pressure counts. A request
        # leaves it when admitted or when it ends, whichever path ends it (``_done``).
        self._waiting: set[int] = set()
        self._accepting = True
        self._stop = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.loaded: LoadedModel | None = None
        """The model once the engine thread has loaded it (None before, or when loading failed)."""
        self._snapshot = EngineSnapshot.empty()
        self._open: dict[int, RequestHandle] = {}
        """Every submitted request not yet finished (the supervisor fails them if need be)."""
        self._beat = time.monotonic()
        """When the engine thread last went round its loop (monotonic seconds)."""
        self._death: str | None = None
        self.failure: str | None = None
        """Why the engine stopped serving, once it has; None while it serves."""
        self._embedder: Embedder | None = None
        self._link: Any = None
        """Rank 0's link when the model is split across machines (its ``lost`` says why the
        group stopped serving)."""
        self.on_group_lost: Callable[[str], None] | None = None
        """Called (from a watcher's thread) the moment the group is lost, so the
        supervisor need not wait for its next round."""
        self._switching = False
        self.switching_to: str | None = None
        """The model a switch is loading (its folder's name), None when none is."""

    # ---- lifecycle (any thread) ----
    def start(self, timeout: float = 600.0) -> None:
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("model did not load in time")
        if isinstance(self._load_error, ModelRefused):
            raise self._load_error  # its message is the whole story
        if self._load_error is not None:
            raise RuntimeError(f"model failed to load: {self._load_error}") from self._load_error

    def stop(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            # a stalled thread never comes back: do not wait for it
            self._thread.join(timeout if self.failure is None else 0.1)

    def stop_admitting(self) -> None:
        with self._lock:
            self._accepting = False

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.failure is None:
            snap = self.snapshot
            if snap.active == 0 and snap.queued == 0 and self._inbox.empty():
                return True
            time.sleep(0.05)
        return False

    def tick_log(self) -> list[Any]:
        """Recent ticks as the engine timed them (``ticks.TickRecord``: target, prediction,
        measurement, decode rows, prefill tokens), oldest first. For tests and debugging;
        read it while the engine is idle."""
        runner = getattr(self, "_runner", None)
        return [] if runner is None else list(runner.timing.log)

    def embed_log(self) -> list[tuple[int, int]]:
        """Recent embedding pieces: (engine ticks run before it, tokens read), oldest
        first. For tests and debugging."""
        return [] if self._embedder is None else list(self._embedder.log)

    @property
    def embedding_tokens(self) -> int:
        """Embedding input tokens read."""
        return 0 if self._embedder is None else self._embedder.tokens_total

    @property
    def embeddings_cancelled(self) -> int:
        """Embedding jobs dropped unfinished because their caller left."""
        return 0 if self._embedder is None else self._embedder.cancelled_total

    def cancel_all(self) -> None:
        self._cancel_all = True
        self._wake.set()

    @property
    def snapshot(self) -> EngineSnapshot:
        """The last tick's snapshot, its ``queued`` counting also what was submitted since
        and not yet taken in (a client that polls /slots after submitting sees its request
        waiting, not an empty engine)."""
        snap = self._snapshot
        waiting = len(self._waiting)
        return snap if waiting <= snap.queued else replace(snap, queued=waiting)

    @snapshot.setter
    def snapshot(self, snap: EngineSnapshot) -> None:
        self._snapshot = snap

    # ---- submission (asyncio thread) ----
    def submit(self, request: GenerationRequest, sink: Callable[[Event], None],
               max_concurrent: int | None = None) -> RequestHandle:
        with self._lock:
            if self.failure is not None:
                raise EngineDown(self.failure)
            if self.switching_to is not None:
                raise ModelChanging(self.switching_to)
            if not self._accepting:
                raise EngineStopping("the server is shutting down")
            if len(self._waiting) >= self.config.max_queue_depth:
                raise EngineBusy("Server is busy. Retry later.")
            live = self._live.get(request.user_key, 0)
            if max_concurrent is not None and live >= max_concurrent:
                raise UserBusy(f"{live} requests in progress; your limit is {max_concurrent} "
                               "at a time; retry when one finishes")
            self._live[request.user_key] = live + 1
            handle = RequestHandle(request, sink)
            self._waiting.add(handle.rid)
            self._open[handle.rid] = handle
        self._inbox.put(handle)
        self._wake.set()
        return handle

    def embed(self, rows: list[list[int]],
              done: Callable[[list[list[float]] | None, str | None], None],
              user: str = "", request_id: str = "") -> EmbedJob:
        """Queue rows of token ids for embedding, read in pieces after the ticks and
        charged to ``user``'s fairness counter; ``done`` is called on the engine thread
        with the vectors (or an error: ``embed.CANCELLED`` once a cancelled job has left).
        Cancel with :meth:`cancel_embedding`."""
        if self.failure is not None:
            raise EngineDown(self.failure)
        if self._link is not None:
            raise EngineStopping("embeddings are not served while the model is split across "
                                 "machines (docs/distributed.md)")
        if not self._accepting or self._embedder is None:
            raise EngineStopping("the server is shutting down")
        job = EmbedJob(rows, done, user, request_id)
        self._embedder.submit(job)
        self._wake.set()
        return job

    def cancel_embedding(self, job: EmbedJob) -> None:
        """Stop reading ``job`` (its KV is freed before the next piece is read)."""
        job.cancelled.set()
        self._wake.set()

    def cancel(self, handle: RequestHandle) -> None:
        handle.cancel()
        self._wake.set()

    def live_requests(self, user_key: str) -> int:
        with self._lock:
            return self._live.get(user_key, 0)

    def set_weights(self, weights: dict[str, float]) -> None:
        """New per-user weights for the running scheduler (applied on the next tick)."""
        def apply(runner: Runner) -> None:
            for user, w in weights.items():
                runner.scheduler.counters.set_weight(user, w)
        self._control.put(apply)
        self._wake.set()

    def restrict(self, user_key: str, access: UserAccess) -> None:
        """What an admin left one user allowed; their running requests obey it within a tick
        (``Runner.restrict``)."""
        self._control.put(lambda runner: runner.restrict(user_key, access))
        self._wake.set()

    def release_cache(self, user_key: str) -> None:
        """Forget one user's prompt-cache entries (on the engine thread's next tick)."""
        self._control.put(lambda runner: runner.release_cache(user_key))
        self._wake.set()

    def check_grammar(self, grammar: str) -> str | None:
        """Why the engine could not run ``grammar`` (an llguidance error class), or None when
        it can: checked at admission, so a schema that fails at its first token is a 400,
        not a 500. Any thread (the API calls it off the event loop); results are kept for
        the last ``GRAMMAR_CHECKS_KEPT`` grammars (Home Assistant resends the same one)."""
        loaded = self.loaded
        if loaded is None:
            return None
        with self._lock:
            if grammar in self._grammar_checks:
                return self._grammar_checks[grammar]
        # here, not at the top: grammar.py imports mlx, which the web layer must not load
        from appliance.engine.grammar import ll_tokenizer, probe_grammar

        vocab = int(loaded.config.get("vocab_size") or 0) or 1 << 30  # as the runner's
        error = probe_grammar(ll_tokenizer(loaded.tokenizer, vocab, loaded.eos_token_ids),
                              grammar)
        with self._lock:
            self._grammar_checks[grammar] = error
            while len(self._grammar_checks) > GRAMMAR_CHECKS_KEPT:
                del self._grammar_checks[next(iter(self._grammar_checks))]
        return error

    def restore_counters(self, values: dict[str, float]) -> None:
        self._control.put(lambda runner: runner.scheduler.counters.restore(values))
        self._wake.set()

    def switch_model(self, path: Path, drain_s: float, load_s: float = 600.0,
                     then: Callable[[LoadedModel], None] | None = None) -> LoadedModel:
        """Serve the model at ``path`` instead (any thread but the engine's; it blocks):
        admit nothing new, let what runs finish for ``drain_s`` and cancel the rest (the
        drain of a restart), then the engine thread loads the new model between ticks and
        swaps it in, so it stays MLX's only user. ``then`` runs before admission opens again
        (the caller's facts about the model: no request is tokenised for the old one and run
        on the new). A model that fails to load raises its error and the old one goes on
        serving; either way admission opens again."""
        with self._lock:
            if self.config.group is not None:
                raise SwitchRefused("the model is served across machines; restart the group "
                                    "with the new model (docs/distributed.md)")
            if self.failure is not None:
                raise EngineDown(self.failure)
            if self._switching or not self._accepting:
                raise SwitchRefused("another change of model, or a shutdown, is under way")
            self._switching = True
            self.switching_to = path.name
        try:
            if not self.wait_idle(drain_s):
                log.warning("model switch: drain timeout after %.0f s; cancelling what is "
                            "left", drain_s)
                self.cancel_all()
                self.wait_idle(10.0)
            done = threading.Event()
            result: list[LoadedModel | BaseException] = []

            def swap(runner: Runner) -> None:
                try:
                    result.append(self._swap(path, runner))
                except BaseException as exc:  # the old model keeps serving
                    result.append(exc)
                finally:
                    done.set()

            self._control.put(swap)
            self._wake.set()
            if not done.wait(load_s):
                raise TimeoutError(f"the model did not load in {load_s:.0f} s")
            if isinstance(result[0], BaseException):
                raise result[0]
            if then is not None:
                then(result[0])
            return result[0]
        finally:
            with self._lock:
                self._switching = False
                self.switching_to = None

    def _swap(self, path: Path, old: Runner) -> LoadedModel:
        """On the engine thread, with nothing running: load, then replace runner and model.
        The fairness counters carry over; the prompt cache and grammar checks do not."""
        import gc

        log.info("model switch: loading %s", path)
        loaded = load_model(path, self.config.ctx_size, fast_cpu_ops=self.config.fast_cpu_ops,
                            native=self.config.native)
        runner = self._runner_for(loaded, self._sched_config(loaded))
        old.flush_counters()
        runner.scheduler.counters.restore(old.scheduler.counters.snapshot())
        self._runner = runner
        self.loaded = loaded
        if self._embedder is not None:
            self._embedder.fail_all("the model was changed")
        self._embedder = _embedder_for(loaded)
        with self._lock:
            self._grammar_checks.clear()
        self.snapshot = runner.snapshot()
        gc.collect()  # the old model's arrays go now, not at some later collection
        log.info("model switch: serving %s", loaded.name)
        return loaded

    def _runner_for(self, loaded: LoadedModel, sched: SchedulerConfig,
                    link: Any = None) -> Runner:
        """The runner of ``loaded``, at start and at a model switch alike."""
        from appliance.engine.runner import Runner

        return Runner(loaded, Scheduler(sched), self._clock, self._fault, self._on_finish,
                      usage=self.usage, on_done=self._done, on_counters=self._on_counters,
                      # across machines a cached prefix would need its KV on each
                      prompt_cache_entries=0 if link is not None
                      else self.config.prompt_cache_entries,
                      meter=self._meter, link=link, drafts=self.config.draft_tokens)

    def _sched_config(self, loaded: LoadedModel) -> SchedulerConfig:
        sched = self.config.scheduler
        if self.kv_budget_bytes is not None:
            sched = replace(sched, kv_budget_tokens=max(
                1, self.kv_budget_bytes // loaded.kv_bytes_per_token))
        return sched

    def _done(self, handle: RequestHandle) -> None:
        user_key = handle.request.user_key
        with self._lock:
            self._open.pop(handle.rid, None)
            self._waiting.discard(handle.rid)
            left = self._live.get(user_key, 0) - 1
            if left > 0:
                self._live[user_key] = left
            else:
                self._live.pop(user_key, None)

    # ---- health (any thread) ----
    def check(self, now: float | None = None) -> str | None:
        """Why the engine is not serving, or None when it is: its thread died, or it has
        not gone round its loop for ``stall_timeout_s`` while requests wait. Once the
        engine has failed it stays failed (the daemon must restart)."""
        if self.failure is not None:
            return self.failure
        link = self._link
        if link is not None and link.lost is not None:
            return f"the machines serving the model together were parted: {link.lost}"
        group = self.config.group
        if group is not None and group.returned is not None:
            with self._lock:
                nobody_waits = not self._open
            if nobody_waits:  # a planned restart
                return (f"{group.returned} is back: restarting to serve the model on both "
                        "machines")
        thread = self._thread
        if thread is None or not self._ready.is_set() or self._load_error is not None:
            return None
        if not thread.is_alive():
            if self._stop:
                return None
            return f"engine thread died ({self._death or 'unknown cause'})"
        limit = self.config.stall_timeout_s
        if limit <= 0:
            return None
        now = time.monotonic() if now is None else now
        idle = now - self._beat
        with self._lock:
            waiting = len(self._open)
        waiting += len(self._embedder or ())
        if waiting and idle > limit:
            return (f"engine stalled: no tick for {idle:.0f} s while {waiting} requests "
                    "wait")
        return None

    def fail(self, reason: str) -> int:
        """Declare the engine down: admit nothing more and end every request in flight
        with ``unavailable`` (HTTP 503). Returns how many requests were ended. Safe from any
        thread: each request is finished exactly once even if the engine thread wakes."""
        with self._lock:
            if self.failure is None:
                self.failure = reason
            self._accepting = False
            handles = list(self._open.values())
            self._open.clear()
        for h in handles:
            usage = self._end_record(h)
            h.emit(FinishEvent(FinishReason.ERROR, usage, error=reason, unavailable=True))
        if self._embedder is not None:
            self._embedder.fail_all(reason)
        return len(handles)

    def _end_record(self, h: RequestHandle) -> Usage:
        """A request the supervisor ends: its usage so far, and, when the engine had taken
        it, its ledger row (what it computed and sent stays counted, as for any request
        that ends). The engine thread may be stuck or gone: its sequence is only read."""
        runner = getattr(self, "_runner", None)  # None until the model has loaded
        seq = None if runner is None else runner.seqs.get(h.rid)
        if seq is None:  # never taken from the inbox: nothing computed
            return Usage(len(h.request.prompt), 0)
        usage = seq.usage()
        seq.hand_ledger(self._on_finish, FinishReason.ERROR, usage, self._clock())
        return usage

    # ---- the engine thread ----
    def _main(self) -> None:
        try:
            import psutil

            group = self.config.group
            self.loaded = load_model(self.config.model_path, self.config.ctx_size,
                                     fast_cpu_ops=self.config.fast_cpu_ops,
                                     native=self.config.native,
                                     split=None if group is None else group.split)
            link = None if group is None else group.start(self.loaded.model,
                                                              self.loaded.weight_bytes)
            if link is not None:
                link.on_lost = self._group_lost
            self._link = link
            self.kv_budget_bytes = budget_bytes(self.config.kv_cache_budget,
                                                psutil.virtual_memory().available)
            sched = self._sched_config(self.loaded)
            log.info("kv budget: %s bytes (%s tokens)", self.kv_budget_bytes,
                     sched.kv_budget_tokens)
            runner = self._runner_for(self.loaded, sched, link)
        except BaseException as exc:  # reported to start()'s caller
            self._load_error = exc
            self._ready.set()
            return
        self._runner = runner
        if link is None:  # embeddings read the whole model at once: not across machines
            self._embedder = _embedder_for(self.loaded)
        self._cancel_all = False
        self._beat = time.monotonic()
        self._ready.set()
        try:
            while not self._stop and self.failure is None:
                runner = self._runner  # a model switch replaces it between ticks
                if not runner.seqs and not self._inbox.empty():
                    self._gather()
                worked = self._step(runner)
                self._beat = time.monotonic()
                if not worked:
                    self._wake.wait(0.5)
                    self._beat = time.monotonic()
        except GroupLost as exc:  # the supervisor sees the link's reason and restarts
            log.critical("engine: the group was lost: %s", exc)
            runner.fail_everything(f"the model's other machine was lost: {exc}",
                                   unavailable=True)
            self.snapshot = runner.snapshot()
            return
        except BaseException as exc:  # the supervisor sees the dead thread and says why
            self._death = type(exc).__name__
            log.critical("engine thread died: %s", type(exc).__name__, exc_info=True)
            return
        if self._embedder is not None:
            self._embedder.fail_all("the server is shutting down")
        if self.failure is None:
            runner.cancel_everything()
            runner.flush_counters()
            runner.timing.report_longest()  # the spell the stop cut short
            self.snapshot = runner.snapshot()
        if self.config.group is not None:
            self.config.group.close()

    def _group_lost(self, reason: str) -> None:
        self._wake.set()
        if self.on_group_lost is not None:
            self.on_group_lost(reason)

    def group_status(self) -> dict[str, Any] | None:
        """The machines serving the model together (None: one machine)."""
        group = self.config.group
        return None if group is None else group.status()

    def _gather(self) -> None:
        """Requests arrived while nothing runs: wait while more arrive (see ``gather_s``)."""
        for _ in range(GATHER_ROUNDS if self.config.gather_s > 0 else 0):
            self._wake.clear()
            if (self._stop or not self._control.empty()
                    or not self._wake.wait(self.config.gather_s)):
                return

    def _step(self, runner: Runner) -> bool:
        """One round of the loop; returns whether it did work. A per-request failure ends
        that request inside the runner; what escapes to here ends the requests in flight
        (nobody could be blamed) and the engine keeps serving."""
        self._wake.clear()
        while not self._control.empty():
            try:
                self._control.get_nowait()(runner)
            except Exception:
                log.exception("engine control message failed")
        runner = self._runner  # a model switch (a control message) may have replaced it
        try:
            runner.take(self._drain_inbox())
            if self._cancel_all:
                runner.cancel_everything()
                self._cancel_all = False
            ticked = runner.tick()
            worked = ticked
            # embeddings: one piece after the tick, within what the tick's budget leaves
            if self._embedder is not None and self._embedder.pending:
                worked = runner.embed(self._embedder, ticked) or worked
        except Exception:
            log.exception("engine tick failed; ending the requests in flight")
            runner.fail_everything()
            worked = True
        left = runner.left_queue()
        if left:
            with self._lock:
                self._waiting.difference_update(left)
        try:
            self.snapshot = runner.snapshot()
        except Exception:
            log.exception("engine snapshot failed")
        return worked

    def _drain_inbox(self) -> list[RequestHandle]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out


def _embedder_for(loaded: LoadedModel) -> Embedder:
    """The embeddings' reader of ``loaded``, padding with its pad token (else an EOS)."""
    pad = loaded.tokenizer.pad_token_id
    return Embedder(loaded.model, pad if pad is not None else next(iter(loaded.eos_token_ids), 0))
