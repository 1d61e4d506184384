"""A model split into pipeline stages over MLX's distributed group (MLX only).

Rank 0 holds the first layers, the embedding and the head; rank ``r`` the ``r``-th slice of
the layers after them. A forward on rank 0 embeds, runs its layers and sends the hidden
states on; each later rank receives them, runs its layers and sends them on; the last
rank's hidden states come back to every rank by one ``all_gather`` (each rank contributes
what it last sent or computed: a collective every rank enters, so no rank waits on a
partner that is not listening), and rank 0 applies the head. Every rank evaluates its own
layers apart from the ring's operations (one forward's, never two forwards' in one graph:
a receive posted before the send it pairs with would deadlock), so each knows whether it
computes or waits on the ring: a machine judged by how long a step takes would be dropped
as dead for computing slowly (issue 52); a ring operation waited on for ``step_timeout``
by every machine is a hang. Rank 0 evaluates its part up to the hidden states that come
back (so an error after that, in its head or sampling, leaves the other machines in step).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from appliance.distributed.control import COMPUTE, IDLE, RING
from appliance.distributed.link import Link


class Stage:
    """This process's part of a pipelined model (set as the model's ``_appliance_stage``,
    read by :func:`appliance.engine.mixed.mixed_step`)."""

    def __init__(self, group: Any, hidden: int, dtype: Any, link: Link | None = None) -> None:
        """``dtype``: what the hidden states cross the ring in, the same on every rank
        (rank 0's hidden states' after its load adapted the model to the backend)."""
        self.group = group
        self.link = link
        """Rank 0's: the plan goes out before a forward's hidden states do."""
        self.rank = group.rank()
        self.size = group.size()
        self.first = self.rank == 0
        self.hidden = hidden
        self.dtype = dtype
        self.phase = IDLE
        self.since = time.monotonic()
        """When :attr:`phase` began (monotonic; read by the beat thread)."""

    def enter(self, phase: str) -> None:
        self.since = time.monotonic()
        self.phase = phase

    def receive(self, tokens: int) -> mx.array:
        """The previous stage's hidden states for ``tokens`` tokens (evaluated: what
        follows is this machine's computing)."""
        h = mx.distributed.recv((tokens, self.hidden), self.dtype, self.rank - 1,
                                group=self.group)
        self.enter(RING)
        mx.eval(h)
        self.enter(COMPUTE)
        return h

    def pass_on(self, h: mx.array) -> mx.array:
        """Send ``h`` on (but from the last stage) and gather the last stage's: on rank 0
        the hidden states the head reads, elsewhere the array to evaluate."""
        start = time.perf_counter()
        h = h.astype(self.dtype)  # every rank sends and gathers the one agreed dtype
        mx.eval(h)  # this machine's layers, before any ring operation of the forward
        out = h
        if self.rank < self.size - 1:
            out = mx.distributed.send(h, self.rank + 1, group=self.group)
        gathered = mx.distributed.all_gather(out, group=self.group)
        if not self.first:
            self.enter(RING)
            mx.eval(gathered)
            self.enter(COMPUTE)
            return gathered
        assert self.link is not None
        t = h.shape[0]
        back = gathered[(self.size - 1) * t:]
        self.link.ship(t)
        self.link.run(back, start)  # evaluated here: what follows is rank 0's alone
        return back


def attach(model: Any, stage: Stage) -> None:
    """Make ``model`` (already sliced to the stage's layers) run as ``stage``."""
    object.__setattr__(model, "_appliance_stage", stage)
