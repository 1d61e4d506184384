"""Speculative decoding by prompt lookup: no second model. A stream's last few tokens are
looked up in its own prompt and output; the tokens that followed their latest earlier
occurrence are proposed as drafts, and one forward reads the stream's next token with the
drafts behind it (:meth:`appliance.engine.batch.DecodeBatch.verify`). Position ``i`` is
sampled as the plain step would sample it, with the drafts before it as its context; the
drafts are kept up to the first one that differs from its sample, and that sample is the
step's last token. Each sample has the distribution of the plain step's (a draft is a
point mass: keeping it when the sample equals it, else taking the sample, is the
acceptance rule of speculative sampling for it), so greedy and seeded requests get the
same tokens, but for the rounding of a forward that reads several positions
(docs/decisions/prompt-lookup.md).

What a verify costs next to a plain step depends on the device (on a 2-core CPU a draft
token costs a quarter to a third of a 1B step; on a GPU next to nothing) and is fitted from the
engine's own verifies; whether drafts come true depends on the text (a summary quoting its
document, code being edited, a loop). :class:`Drafting` proposes only as many drafts as
pay for themselves by those two estimates, so a stream whose drafts fail goes back to
plain steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from appliance.sched.cost import OnlineFit

LONGEST_NGRAM = 4
SHORTEST_NGRAM = 2
"""The n-grams looked up, longest first. One token alone matches almost anywhere and its
drafts seldom come true."""

VERIFY_PRIOR = (1.2, 0.3)
"""A verify's time in plain decode steps: a fixed share and a share per draft token (as
fitted on a 2-core Zen 4: a 1B Q4_K_M file 0.9-1.2 + 0.2-0.3, SmolLM2 1.7-1.9 +
0.16-0.4). Fitted from each verify; from this prior a stream first drafts two tokens, and
a device where drafts are nearly free learns it."""

ROWS_PRIOR = 2.0
"""Several rows' verify over the cost model's price of it (the rows' step with the drafts
riding): on a 2-core Zen 5 serving SmolLM2 to four clients, every such verify ran 2-3x it
(four rows with a draft each 40-52 ms, a plain step of the four 14), and each was its
streams' longest gap, for the first of each run was planned at a ratio of 1. From 2 they
wait for exploration (:data:`EXPLORE_EVERY`), and a device where they are cheap learns
it from that one."""

PRIOR_WEIGHT = 4.0
"""A stream's drafts are expected to come true as often as its text has repeated the
earlier occurrence (:meth:`StreamDrafts.prior`), as if seen this many times, besides its
own record of drafts."""
LONGEST_RUN = 64

EXPLORE_EVERY = 32
"""Drafts declined in a row (their verify was expected to cost more than they keep, or to
last longer than a tick may), after which one draft is verified anyway, so the fitted cost
follows the machine: one slow first verify (a cold start, a busy spell) had shut drafts
out for the engine's life."""

ACCEPT_MEMORY = 16.0
"""Tokens over which a stream's own record of drafts weighs half as much: a stream whose
drafts failed tries again some tokens later, when its text may have turned to quoting."""


def agreed(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts came true: those before the first that differs from its sample."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


@dataclass(slots=True)
class StreamDrafts:
    """One stream's n-gram index and record of drafts."""

    seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    """Each n-gram of the tokens indexed so far: the position after its latest occurrence."""
    indexed: int = 0
    """N-grams ending before this position are in :attr:`seen`."""
    run: int = 0
    """Tokens the last match repeated its earlier occurrence for (at most
    :data:`LONGEST_RUN`)."""
    accepted: float = 0.0
    tried: float = 0.0
    at: int = 0
    """Tokens of the stream when the record was last decayed."""

    def propose(self, tokens: list[int], most: int) -> list[int]:
        """Up to ``most`` tokens that followed the latest earlier occurrence of the longest
        of ``tokens``' last n-grams found; none when no n-gram recurs."""
        end = len(tokens) - 1  # the last n-gram itself is not an earlier occurrence
        for j in range(max(self.indexed, SHORTEST_NGRAM), end + 1):
            for n in range(SHORTEST_NGRAM, min(LONGEST_NGRAM, j) + 1):
                self.seen[tuple(tokens[j - n:j])] = j
        self.indexed = max(self.indexed, end + 1)
        for n in range(min(LONGEST_NGRAM, len(tokens)), SHORTEST_NGRAM - 1, -1):
            after = self.seen.get(tuple(tokens[-n:]))
            if after is not None:  # copied on into the drafts themselves, as a repeat goes on
                self.run = n
                while (self.run < min(LONGEST_RUN, after)
                       and tokens[after - 1 - self.run] == tokens[-1 - self.run]):
                    self.run += 1
                drafts = tokens[after:after + most]
                while len(drafts) < most:
                    drafts.append(drafts[len(drafts) - (len(tokens) - after)])
                return drafts
        return []

    def prior(self) -> float:
        """The chance that the next token goes on repeating, by the rule of succession
        over the tokens the last match has repeated: 0.75 after two, 0.9 after eight."""
        return (self.run + 1) / (self.run + 2)

    def rate(self, length: int) -> float:
        """The expected chance that a draft comes true, given the one before it did."""
        if length > self.at:
            keep = 0.5 ** ((length - self.at) / ACCEPT_MEMORY)
            self.accepted *= keep
            self.tried *= keep
            self.at = length
        return ((self.accepted + self.prior() * PRIOR_WEIGHT)
                / (self.tried + PRIOR_WEIGHT))

    def record(self, drafted: int, kept: int) -> None:
        """A verify kept ``kept`` of ``drafted`` drafts: each kept one came true, and the
        first one not kept, if any, did not."""
        self.accepted += kept
        self.tried += kept + (1 if kept < drafted else 0)


class Drafting:
    """How many drafts a stream verifies (``most`` at most; 0: never), from its record and
    the fitted cost of a verify (:meth:`plan`; several rows together: :meth:`plan_rows`).
    A verify lasts at most ``longest`` plain steps: the tick objective while a batch
    decodes (``itl_factor``), so the stream's gap before its kept drafts is no longer than
    a tick's may be (docs/decisions/prompt-lookup.md)."""

    def __init__(self, most: int, longest: float = 2.0) -> None:
        self.most = most
        self.longest = longest
        self.verify_fit = OnlineFit(VERIFY_PRIOR, forget=0.9)
        """A verify's seconds over a plain step's predicted seconds, by draft tokens."""
        self.rows_fit = OnlineFit((ROWS_PRIOR,), forget=0.9)
        """Several rows' verify: its seconds over the cost model's prediction of their
        step with the drafts riding in it (appliance/engine/forwards.py)."""
        self.drafted = 0
        self.accepted = 0
        self.verifies = 0
        self.declined = 0
        """Proposals declined since the last verify (:data:`EXPLORE_EVERY`)."""

    def verify_cost(self, drafts: int) -> float:
        """A verify of ``drafts`` drafts in plain decode steps."""
        return self.verify_fit.predict((1.0, float(drafts)))

    def plan(self, stream: StreamDrafts, tokens: list[int], room: int,
             longest: float | None = None) -> list[int]:
        """The drafts worth verifying after ``tokens``; ``room``: tokens the stream may
        still generate (the step's own token included); ``longest``: plain steps a verify
        may last, if not :attr:`longest`."""
        longest = self.longest if longest is None else longest
        most = min(self.most, room - 1)
        if most < 1:
            return []
        drafts = stream.propose(tokens, most)
        if not drafts:
            return []
        return drafts[:self._best(stream.rate(len(tokens)), len(drafts), self.verify_cost,
                                  longest)]

    def _best(self, rate: float, most: int, cost: Callable[[int], float],
              longest: float) -> int:
        """How many drafts to verify, each coming true with chance ``rate`` given the one
        before did, ``cost(k)`` plain steps for ``k``: the most expected tokens per step's
        time within ``longest``, or none (after :data:`EXPLORE_EVERY` declined proposals,
        one anyway: a look at what a verify costs now)."""
        best, best_k = 1.0, 0  # a plain step: one token for one step
        expected = 1.0
        for k in range(1, most + 1):
            expected += rate ** k
            spent = cost(k)
            if spent > longest:
                break
            if expected / spent > best:
                best, best_k = expected / spent, k
        if best_k == 0:
            self.declined += 1
            if self.declined < EXPLORE_EVERY or rate <= 0.5:
                return 0
            best_k = 1
        self.declined = 0
        return best_k

    def observe(self, stream: StreamDrafts, drafted: int, kept: int, seconds: float,
                step_s: float) -> None:
        """A verify of ``drafted`` drafts kept ``kept`` and took ``seconds``, where a plain
        step was predicted to take ``step_s``."""
        stream.record(drafted, kept)
        self.drafted += drafted
        self.accepted += kept
        self.verifies += 1
        if step_s > 0:
            self.verify_fit.observe((1.0, float(drafted)), seconds / step_s)

    def plan_rows(self, streams: Sequence[StreamDrafts], contexts: Sequence[list[int]],
                  rooms: Sequence[int], cost: Callable[[int], float],
                  longest: float | None = None) -> list[list[int]]:
        """Drafts for each of several rows decoding together, as many for each, or none.
        Their KV stays aligned: every row keeps as many drafts as the row that keeps fewest
        (a row's first ``m`` drafts and its sample after them are what a plain step would
        have made, whatever it would have kept beyond). ``cost(k)``: a verify of ``k``
        drafts a row in the batch's plain steps, as the cost model predicts it, corrected
        by :attr:`rows_fit`."""
        longest = self.longest if longest is None else longest
        most = min(self.most, *(room - 1 for room in rooms))
        if most < 1:
            return []
        drafts = []
        for stream, tokens in zip(streams, contexts, strict=True):
            found = stream.propose(tokens, most)
            if not found:
                return []
            drafts.append(found)
        every = 1.0  # the chance that every row's next draft comes true
        for stream, tokens in zip(streams, contexts, strict=True):
            every *= stream.rate(len(tokens))
        correction = self.rows_fit.predict((1.0,))
        k = self._best(every, min(len(d) for d in drafts), lambda k: cost(k) * correction,
                       longest)
        return [d[:k] for d in drafts] if k else []

    def observe_rows(self, streams: Sequence[StreamDrafts], drafted: int, kept: Sequence[int],
                     seconds: float, predicted_s: float) -> None:
        """A verify of ``drafted`` drafts a row, each row's first ``kept`` true, took
        ``seconds`` where the cost model predicted ``predicted_s``."""
        for stream, n in zip(streams, kept, strict=True):
            stream.record(drafted, n)
        self.drafted += drafted * len(streams)
        self.accepted += min(kept) * len(streams)
        self.verifies += 1
        if predicted_s > 0:
            self.rows_fit.observe((1.0,), seconds / predicted_s)
