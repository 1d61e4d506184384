"""The plan rank 0 sends each other machine before a pipelined forward (no MLX): what
changed in the decode batch since the last one and which rows and prompt chunks the
forward reads.

It travels on the control channel (appliance/distributed/control.py), not MLX's ring: a
ring receive polls while it waits (2.0 s of CPU in 4.0 s of waiting, measured), so a
follower waiting there for the next plan would burn half a core all day; on a socket it
sleeps. The hidden states themselves go over the ring. A message carries its step number
and a checksum of its operations, and every machine checks both before it acts: machines
that disagree about a forward's shapes would otherwise exchange misshapen tensors and
compute garbage without an error.

Operations, in the order rank 0 did them:

- ``["join", [rid, ...]]``: those sequences' caches join the decode batch, in that order;
- ``["remove", [rid, ...]]``: those rows leave it;
- ``["expect", rows, length, ticks]``: prompts being read will join it (its room is made
  ahead, ``DecodeBatch.expect``);
- ``["reset"]``: the batch starts empty;
- ``["forward", rows, [[rid, start, n], ...], [rid, ...]]``: one forward of the batch's
  ``rows`` decode rows (all of them; 0: the chunks alone) and prompt chunks (``n`` tokens of sequence ``rid`` from position
  ``start``, a fresh cache when it is 0), then the sequences whose own caches rank 0 still
  holds (any other is dropped);
- ``["stop"]``: rank 0 is shutting down cleanly.
"""

from __future__ import annotations

import json
import zlib
from typing import Any


class PlanError(RuntimeError):
    """A plan that fails its checks: the machines no longer agree (the group restarts)."""


def _crc(ops: list[Any]) -> int:
    return zlib.crc32(json.dumps(ops, separators=(",", ":")).encode())


def encode(ops: list[Any], step: int) -> dict[str, Any]:
    return {"plan": {"step": step, "ops": ops, "crc": _crc(ops)}}


def decode(message: dict[str, Any], step: int) -> list[Any]:
    """The operations of plan message ``message``, which must be step ``step``."""
    plan = message.get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("ops"), list):
        raise PlanError("a control message that is not a plan")
    if plan.get("step") != step:
        raise PlanError(f"plan for step {plan.get('step')}, expected step {step}")
    ops: list[Any] = plan["ops"]
    if _crc(ops) != plan.get("crc"):
        raise PlanError(f"plan for step {step} fails its checksum")
    return ops
