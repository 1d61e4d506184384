"""Fairness: virtual token counters (VTC) with classes, aging, and the ``fair`` queue policy.

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): each user has a
counter of the weighted tokens the engine computed for them; whoever has been served least
goes next. On top of that, classes (voice > interactive > background) come first, and aging
lifts a waiting request one class per ``aging_seconds`` so background work always starts.

Pure: the caller passes ``now``; nothing here reads a clock, a database or MLX.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from appliance.sched.states import RequestState
from appliance.sched.types import DEFAULT_AGING_SECONDS, DEFAULT_W_IN, DEFAULT_W_OUT, SeqView
from appliance.vocab import WEIGHT_MAX, WEIGHT_MIN, Klass


def effective_class(klass: Klass, waited: float, aging_seconds: float) -> Klass:
    """``min(VOICE, klass + floor(waited / aging_seconds))``; ``aging_seconds == 0`` disables
    aging (a request then keeps its own class however long it waits)."""
    if aging_seconds <= 0 or waited <= 0 or math.isinf(aging_seconds):
        return klass
    steps = int(waited // aging_seconds)
    return Klass(min(int(Klass.VOICE), int(klass) + steps))


def _check_weight(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(slots=True)
class VirtualCounters:
    """Per-user virtual token counters ``c_u``.

    Serving user u adds ``(w_in * prefill tokens computed + w_out * output tokens) / weight_u``
    (prompt tokens served from the prompt cache are not computed and cost nothing). When a
    user with nothing queued or running becomes backlogged, ``c_u = max(c_u, floor)``, where
    ``floor`` is the lowest counter among the users already backlogged, or, when nobody is,
    the lowest counter of the last backlog seen: idle time banks no credit.
    """

    w_in: float = DEFAULT_W_IN
    w_out: float = DEFAULT_W_OUT
    _values: dict[str, float] = field(default_factory=dict)
    _weights: dict[str, float] = field(default_factory=dict)
    _backlogged: frozenset[str] = frozenset()
    _floor: float = 0.0

    def __post_init__(self) -> None:
        for name in ("w_in", "w_out"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0")

    def get(self, user: str) -> float:
        return self._values.get(user, 0.0)

    def weight(self, user: str) -> float:
        return self._weights.get(user, 1.0)

    def set_weight(self, user: str, weight: float) -> None:
        """A user with weight 2 is entitled to twice the service of a user with weight 1.
        Clamped into [WEIGHT_MIN, WEIGHT_MAX] (a weight stored before the bounds existed,
        say 1e-320, must not turn a counter into infinity)."""
        self._weights[user] = min(max(_check_weight("weight", weight), WEIGHT_MIN), WEIGHT_MAX)

    def charge(self, user: str, prefill_tokens: int, output_tokens: int) -> float:
        """Add the cost of work done for ``user``; returns the amount added."""
        if prefill_tokens < 0 or output_tokens < 0:
            raise ValueError("token counts must be >= 0")
        cost = (self.w_in * prefill_tokens + self.w_out * output_tokens) / self.weight(user)
        self._values[user] = self.get(user) + cost
        return cost

    def observe(self, backlogged: Iterable[str]) -> None:
        """Note who is backlogged (queued or running) now; lift the users who just became so."""
        current = frozenset(backlogged)
        staying = current & self._backlogged
        # The users still backlogged; when all have left, the lowest of the last backlog.
        floor = min((self.get(u) for u in staying or self._backlogged), default=self._floor)
        for user in current - self._backlogged:
            self._values[user] = max(self.get(user), floor)
        self._floor = min((self.get(u) for u in current), default=floor)
        self._backlogged = current

    @property
    def backlogged(self) -> frozenset[str]:
        return self._backlogged

    def snapshot(self) -> dict[str, float]:
        """Every counter, for persistence and the dashboard."""
        return dict(self._values)

    def weights(self) -> dict[str, float]:
        """Every weight set so far (a user not in it has weight 1)."""
        return dict(self._weights)

    def restore(self, values: Mapping[str, float]) -> None:
        """Load persisted counters (at start-up, before any request is seen). A value that
        is not a finite number >= 0 (persisted before weights were bounded) starts again
        from the lowest sound counter, as a newly backlogged user would."""
        sound = {u: float(v) for u, v in values.items() if math.isfinite(v) and v >= 0}
        floor = min(sound.values(), default=0.0)
        self._values = {u: sound.get(u, floor) for u in values}
        self._floor = floor
        self._backlogged = frozenset()


@dataclass(slots=True)
class FairPolicy:
    """The ``fair`` queue policy: class (with aging), then lowest counter, then arrival.

    Aging lifts a request's class by ``floor(wait / aging_seconds)``, capped at VOICE and at
    the highest class among the requests being ordered. The second cap is a deliberate
    choice: aging exists to carry lower classes past a stream of higher-class work. Without
    the cap, two requests of the *same* class would be ordered by how long they waited as soon
    as the queue grew longer than ``aging_seconds``, and ``fair`` would turn into ``fcfs``
    exactly when fairness matters most (under sustained load).

    The wait is measured from arrival, so a preempted request keeps its age: it is readmitted
    ahead of newer work of its class, which keeps preemption from starving it.
    """

    vtc: VirtualCounters = field(default_factory=VirtualCounters)
    aging_seconds: float = DEFAULT_AGING_SECONDS
    name = "fair"

    def effective_class(self, now: float, seq: SeqView) -> Klass:
        return effective_class(seq.klass, now - seq.arrival, self.aging_seconds)

    def order(self, now: float, seqs: Sequence[SeqView]) -> list[SeqView]:
        """Best-first for prefill: each user's key is the counter plus the prompt still to
        read of their requests being ordered (VTC charges a prompt on admission). A user
        just lifted to the backlog's lowest counter thus goes before the one whose long
        prompts are still being read, instead of after them on arrival order."""
        top = max((int(s.klass) for s in seqs), default=int(Klass.BACKGROUND))
        owed: dict[str, float] = {}
        for s in seqs:
            owed[s.user] = owed.get(s.user, 0.0) + self._cost(s)
        return sorted(seqs, key=lambda s: (-min(int(self.effective_class(now, s)), top),
                                           self.vtc.get(s.user) + owed[s.user],
                                           s.arrival, s.rid))

    def admit_order(self, now: float, queued: Sequence[SeqView],
                    running: Sequence[SeqView]) -> list[SeqView]:
        """The order to fill free slots in: :meth:`order`, except that prefill already
        granted counts against its user at once, as VTC charges a prompt on admission.

        Counters are charged as the work happens, so a user whose long prompt was admitted
        a moment ago still looks cheap; and several slots filled in one tick would otherwise
        all go to the user lowest at the start of it. So each user's key is the counter
        plus ``w_in * remaining prefill / weight`` of their prefilling requests, and of each
        request picked so far in this order.
        """
        vtc = self.vtc
        top = max((int(s.klass) for s in queued), default=int(Klass.BACKGROUND))
        owed: dict[str, float] = {}
        for s in running:
            if s.state is RequestState.PREFILLING:
                owed[s.user] = owed.get(s.user, 0.0) + self._cost(s)
        heads: dict[str, list[SeqView]] = {}
        for s in sorted(queued, key=lambda s: (-min(int(self.effective_class(now, s)), top),
                                               s.arrival, s.rid)):
            heads.setdefault(s.user, []).append(s)
        out: list[SeqView] = []
        while heads:
            user = min(heads, key=lambda u: (
                -min(int(self.effective_class(now, heads[u][0])), top),
                vtc.get(u) + owed.get(u, 0.0), heads[u][0].arrival, heads[u][0].rid))
            s = heads[user].pop(0)
            out.append(s)
            owed[user] = owed.get(user, 0.0) + self._cost(s)
            if not heads[user]:
                del heads[user]
        return out

    def _cost(self, s: SeqView) -> float:
        return self.vtc.w_in * max(s.remaining, 0) / self.vtc.weight(s.user)


def share_victim(vtc: VirtualCounters, best: SeqView, queued: Sequence[SeqView],
                 running: Sequence[SeqView], margin: float) -> SeqView | None:
    """The running request that yields its slot to ``best`` (the queued request admission
    takes first), or None: VTC's order applied to the running rows, for a full batch.

    Requests run to their end, so counters alone choose only who is admitted *next*; with
    every slot held, slots free at the pace of the requests, not of the weights
    (docs/decisions/weighted-shares.md). So among the rows of ``best``'s class, a user who holds more
    than their weighted share of those rows (``rows * w_u / sum of w`` over the users with
    work of that class, rounded down) and whose counter is more than ``margin`` above
    ``best``'s user's gives up one row, their latest. Rounding down and the margin make
    the allocation settle between the two whole-row splits nearest the weights instead of
    swinging: users of weights 1 and 4 on eight rows alternate between 2:6 and 1:7, one
    yield each way, and their counters stay within ``margin`` of each other, so service
    follows the weights whatever the request lengths.
    """
    klass = best.klass
    peers = [s for s in running if s.klass is klass]
    users = {s.user for s in peers} | {s.user for s in queued if s.klass is klass}
    total = sum(vtc.weight(u) for u in users)
    rows = Counter(s.user for s in peers)
    bar = vtc.get(best.user) + margin
    over = [u for u, n in rows.items()
            if u != best.user and vtc.get(u) > bar
            and n > math.floor(len(peers) * vtc.weight(u) / total + 1e-9)]
    if not over:
        return None
    user = max(over, key=lambda u: (vtc.get(u), u))
    return max((s for s in peers if s.user == user), key=lambda s: (s.arrival, s.rid))
