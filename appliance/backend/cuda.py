"""CUDA's plug (MLX's CUDA build on Linux): MLX as shipped, behind the door
(:mod:`~appliance.backend.plug`), with MLX's kernel cache kept in the data folder and a
quantized model's kernels compiled at adoption (:mod:`~appliance.backend.gpu`).

None of the CPU's tuning, and no fused decode layer or batched products of its own (None):
a CUDA kernel would come in through those two attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from appliance.backend import AsShipped


@dataclass(frozen=True, slots=True)
class CudaPlug(AsShipped):
    KIND: ClassVar[str] = "cuda"

    @staticmethod
    def prepare(blas: str, kernel: bool, argv: list[str], data_dir: Path | None) -> None:
        from appliance.backend import gpu, process

        process.log_blas(kernel)
        if data_dir is not None:
            gpu.keep_kernel_cache("cuda", data_dir)

    def adopt(self, model: Any) -> int:
        """Its quantized products' kernels compiled now, not at the first requests."""
        from appliance.backend import gpu

        gpu.warm_quantized(model)
        return 0
