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
    """Contiguous layer spans, rank 0 first, each rank's share of the layers in proportion
    to its memory ``budgets`` (bytes for weights), rank 0 also holding ``edge_bytes`` (the
    embedding, the final norm and the head). Every rank gets at least one layer. Raises
    ValueError, naming the shortfall, when the weights do not fit the budgets."""
    n, size = len(layer_bytes), len(budgets)
    if size < 1 or n < size:
        raise ValueError(f"{n} layers cannot be split over {size} machines")
    total = sum(layer_bytes) + edge_bytes
    if total > sum(budgets):
        raise ValueError(f"the model's weights ({total >> 20} MiB) exceed the machines' "
                         f"memory budgets together ({sum(budgets) >> 20} MiB)")
    room = [max(budgets[0] - edge_bytes, 0), *budgets[1:]]
    layers = sum(layer_bytes)
    cumulative = [0]
    for b in layer_bytes:
        cumulative.append(cumulative[-1] + b)
    spans: list[Span] = []
    lo, goal = 0, 0.0
    for rank in range(size):
        goal += layers * room[rank] / max(sum(room), 1)
        if rank == size - 1:
            hi = n
        else:  # the layer boundary nearest the running goal, a layer each for the rest
            hi = min(range(lo + 1, n - (size - rank - 1) + 1),
                     key=lambda i: abs(cumulative[i] - goal))
        used = cumulative[hi] - cumulative[lo]
        if used > room[rank]:
            raise ValueError(f"machine {rank} would hold {used >> 20} MiB of layers, more "
                             f"than its budget leaves for them ({room[rank] >> 20} MiB)")
        spans.append(Span(rank, lo, hi))
        lo = hi
    return spans
