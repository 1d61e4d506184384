"""How a model's layers are split over the machines of a group (pure: no MLX)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """Rank ``rank``'s layers: ``[lo, hi)`` of the model's ``layers``."""

    rank: int
    lo: int
    hi: int


def split_layers(layer_bytes: list[int], edge_bytes: int, budgets: list[int]) -> list[Span]:
    """Contiguous layer spans, rank 0 first, so that each machine's weights are in
    proportion to its memory ``budgets``; rank 0's include ``edge_bytes`` (the embedding,
    the final norm and the head), so it takes fewer layers. Equal weights per machine also
    balance a decode step, whose time is mostly reading them: a 49k-word head of the
    SmolLM-135M shape reads as much as eight of its layers. Every machine gets at least
    one layer. Raises ValueError, naming the shortfall, when the weights do not fit."""
    n, size = len(layer_bytes), len(budgets)
    if size < 1 or n < size:
        raise ValueError(f"{n} layers cannot be split over {size} machines")
    total = sum(layer_bytes) + edge_bytes
    if total > sum(budgets):
        raise ValueError(f"the model's weights ({total >> 20} MiB) exceed the machines' "
                         f"memory budgets together ({sum(budgets) >> 20} MiB)")
    cumulative = [0]
    for b in layer_bytes:
        cumulative.append(cumulative[-1] + b)
    spans: list[Span] = []
    lo, share = 0, 0.0
    for rank in range(size):
        share += total * budgets[rank] / sum(budgets)
        goal = share - edge_bytes  # where this machine's layers should end
        if rank == size - 1:
            hi = n
        else:  # the layer boundary nearest the goal, a layer each for the rest
            hi = min(range(lo + 1, n - (size - rank - 1) + 1),
                     key=lambda i: abs(cumulative[i] - goal))
        held = cumulative[hi] - cumulative[lo] + (edge_bytes if rank == 0 else 0)
        if held > budgets[rank]:
            raise ValueError(f"machine {rank} would hold {held >> 20} MiB of weights, more "
                             f"than its budget ({budgets[rank] >> 20} MiB)")
        spans.append(Span(rank, lo, hi))
        lo = hi
    return spans
