"""Metal's plug (macOS): MLX as shipped, behind the door (:mod:`~appliance.backend.plug`).

None of the CPU's tuning: no preloaded BLAS, no fast operations, no malloc thresholds, the
plain cost profile (the fit learns the device's costs online). It has no fused decode
layer and no batched products of its own yet (None): a Metal kernel would come in through
those two attributes, and the engine would not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from appliance.backend import AsShipped


@dataclass(frozen=True, slots=True)
class MetalPlug(AsShipped):
    KIND: ClassVar[str] = "metal"
