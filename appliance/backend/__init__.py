"""The device boundary: everything that depends on where MLX computes lives here, behind
one door (:mod:`~appliance.backend.plug`), which the engine and its neutral forward call
and never a device module by name.

- :mod:`~appliance.backend.plug`: the door. Before MLX loads, ``prepare`` (the process:
  Debian's OpenBLAS and the skinny_matmul kernel preloaded on the CPU, MLX's kernel cache
  on CUDA); on the engine thread, ``start`` (the device's plug) and ``adopt`` (a loaded
  model fitted to it); ``of`` (what the neutral forward asks a model's plug for).
- The plugs that ship: :mod:`~appliance.backend.cpu` (the CPU accelerator: fast operations,
  the quantized kernel, the fused decode layer, malloc's thresholds, the CPU's cost
  profile), :mod:`~appliance.backend.metal` and :mod:`~appliance.backend.cuda` (MLX as
  shipped; none of the CPU's tuning, and None where they have no kernel of their own).

This module keeps what every plug shares and what is read before MLX is imported: the
kind of backend, read once from the installed MLX (the process may still restart): Metal
on macOS, CUDA where MLX's CUDA build is installed, the CPU otherwise; and
:class:`Backend`, the facts ``/health`` reports. ``native`` off (the setting,
``APPLIANCE_NATIVE=off``) runs MLX as shipped on every backend: none of the appliance's
compiled code and no malloc tuning; the BLAS library stays the ``blas`` setting's.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from appliance.sched.cost import CostProfile

KINDS = ("cpu", "metal", "cuda")
CUDA_DISTRIBUTIONS = ("mlx-cuda", "mlx-cuda-12", "mlx-cuda-13")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def installed_kind(platform: str = sys.platform) -> str:
    """"metal", "cuda" or "cpu": what the installed MLX computes on (it is not imported)."""
    if platform == "darwin":
        return "metal"
    if any(_installed(name) for name in CUDA_DISTRIBUTIONS):
        return "cuda"
    return "cpu"


NOT_TUNED = "not tuned (native code off or not the CPU)"


@dataclass(frozen=True, slots=True)
class Backend:
    """What serves the model here, as the log line and ``/health`` report it."""

    kind: str
    """"cpu", "metal" or "cuda" (:data:`KINDS`)."""
    device: str
    """MLX's default device, as MLX names it."""
    native: bool
    """The appliance's native code may run here (the setting, and a CPU device)."""
    kernel: str | None
    """The skinny_matmul kernel's instruction set when it is loaded, else None."""
    fast_ops: bool
    """The fast CPU operations are installed in mlx-lm's model modules."""
    quant: str | None
    """The quantized matmul kernel's instruction set when it replaces MLX's, else None."""
    heap: str
    """What malloc's tuning did ("kept", or why not)."""
    profile: CostProfile
    fused_layer: bool = False
    """The fused decode layer (appliance/backend/decode_layer.py) can run here."""
    degraded: tuple[str, ...] = ()
    """What makes this process slower than it could be here, each with the command that
    fixes it (:mod:`~appliance.backend.degraded`); empty when nothing is missing."""

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["profile"] = self.profile.name
        return out


def as_shipped(kind: str) -> dict[str, Any]:
    """The facts of MLX as shipped (no native code, the plain profile) on MLX's default
    device: a GPU plug's."""
    import mlx.core as mx

    from appliance.backend.profile import PLAIN

    return {"kind": kind, "device": str(mx.default_device()), "native": False, "kernel": None,
            "fast_ops": False, "quant": None, "heap": NOT_TUNED, "profile": PLAIN}


@dataclass(frozen=True, slots=True)
class AsShipped(Backend):
    """A plug that runs MLX as shipped (Metal, CUDA): none of the CPU's tuning, a step
    ahead to hide the tick's host part, and no fused decode layer or batched products of
    its own (None), which is where a device's kernels would come in."""

    KIND: ClassVar[str] = ""

    @staticmethod
    def prepare(blas: str, kernel: bool, argv: list[str], data_dir: Path | None) -> None:
        from appliance.backend import process

        process.log_blas(kernel)

    @classmethod
    def start(cls, *, native: bool, fast_cpu_ops: bool) -> Self:
        return cls(**as_shipped(cls.KIND))

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
