"""Metal's plug (macOS): MLX as shipped, behind the door (:mod:`~appliance.backend.plug`).

None of the CPU's tuning: no preloaded BLAS, no fast operations, no malloc thresholds, the
plain cost profile (the fit learns the device's costs online). It has no fused decode
layer and no batched products of its own yet (None): a Metal kernel would come in through
those two attributes, and the engine would not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.backend import Backend, as_shipped


@dataclass(frozen=True, slots=True)
class MetalPlug(Backend):
    @staticmethod
    def prepare(blas: str, kernel: bool, argv: list[str], data_dir: Path | None) -> None:
        from appliance.backend import process

        process.log_blas(kernel)

    @classmethod
    def start(cls, *, native: bool, fast_cpu_ops: bool) -> MetalPlug:
        return cls(**as_shipped("metal"))

    @property
    def look_ahead(self) -> bool:
        return True  # a tick's host part is what a step ahead hides on a GPU

    @property
    def decode_layer(self) -> None:
        return None

    @property
    def products(self) -> None:
        return None

    def adopt(self, model: Any) -> int:
        return 0
