"""A model split into pipeline stages over MLX's distributed group (MLX only).

Rank 0 holds the first layers, the embedding and the head; rank ``r`` the ``r``-th slice of
the layers after them. A forward on rank 0 embeds, runs its layers and sends the hidden
states on; each later rank receives them, runs its layers and sends them on; the last
rank's hidden states come back to every rank by one ``all_gather`` (each rank contributes
what it last sent or computed: a collective every rank enters, so no rank waits on a
partner that is not listening), and rank 0 applies the head. One ``mx.eval`` per forward
and rank: a graph spanning two forwards could post a receive before the send it pairs
with, and deadlock. Rank 0 evaluates its part up to the hidden states that come back (so
an error after that, in its head or sampling, leaves the other machines in step).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from appliance.distributed.link import Link


class Stage:
    """This process's part of a pipelined model (set as the model's ``_appliance_stage``,
    read by :func:`appliance.engine.mixed.mixed_step`)."""

    def __init__(self, group: Any, hidden: int, dtype: Any, link: Link | None = None) -> None:
        self.group = group
        self.link = link
        """Rank 0's: the plan goes out before a forward's hidden states do."""
        self.rank = group.rank()
        self.size = group.size()
        self.first = self.rank == 0
        self.hidden = hidden
        self.dtype = dtype

    def receive(self, tokens: int) -> mx.array:
        """The previous stage's hidden states for ``tokens`` tokens."""
        return mx.distributed.recv((tokens, self.hidden), self.dtype, self.rank - 1,
                                   group=self.group)

    def pass_on(self, h: mx.array) -> mx.array:
        """Send ``h`` on (but from the last stage) and gather the last stage's: on rank 0
        the hidden states the head reads, elsewhere the array to evaluate."""
        out = h
        if self.rank < self.size - 1:
            out = mx.distributed.send(h, self.rank + 1, group=self.group)
        gathered = mx.distributed.all_gather(out, group=self.group)
        if not self.first:
            return gathered
        assert self.link is not None
        t = h.shape[0]
        back = gathered[(self.size - 1) * t:]
        self.link.ship(t)
        self.link.run(back)  # evaluated here: what follows is rank 0's alone
        return back


def attach(model: Any, stage: Stage) -> None:
    """Make ``model`` (already sliced to the stage's layers) run as ``stage``."""
    object.__setattr__(model, "_appliance_stage", stage)
