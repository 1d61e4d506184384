"""The one door to the device: what the engine and its neutral forward
(appliance/engine/mixed.py) ask of wherever MLX computes, and the plugs that ship.

A plug (:class:`Plug`) is chosen once, on the engine thread, by :func:`start`: the CPU's
(:mod:`~appliance.backend.cpu`) where MLX's default device is the CPU, else the installed
MLX's kind (:mod:`~appliance.backend.metal`, :mod:`~appliance.backend.cuda`). It says what
the device is (its facts, :class:`~appliance.backend.Backend`), fits a loaded model to it
(:func:`adopt`: repacking), gives the scheduler its cost profile and the runner whether a
step may be built ahead (``look_ahead``), and gives the forward its fused decode layer and
its batched quantized products, or None where it has none. A future Metal kernel comes in
through the same two attributes; the engine names no device module (scripts/layers.py's
door rule).

:func:`prepare` runs before MLX is imported (it may restart the process), so this module
and the plugs import MLX and their kernels only inside their functions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from appliance.backend import cpu, cuda, installed_kind, metal
from appliance.sched.cost import CostProfile

log = logging.getLogger(__name__)

_ATTR = "_appliance_plug"
"""The attribute :func:`adopt` keeps a model's plug in (a plain one, in no parameter tree)."""


class DecodeLayer(Protocol):
    """A decoder layer's decode step in one operation, prompt chunks riding in it."""

    @property
    def rows(self) -> int:
        """The most tokens (decode rows and riding chunks') a fused step takes."""
        ...

    def plan(self, model: Any, qk_norm: bool) -> list[Any | None] | None:
        """Each layer as :meth:`step` takes it (None where it does not); None for the
        whole model where the operation is not here."""
        ...

    def step(self, layer: Any, h: Any, keys: Any, values: Any, offset: Any, mask: Any,
             at: int, first: int, chunks: Sequence[tuple[Any, Any, int, int]] = (),
             span: int = 1) -> list[Any] | None:
        """The layer's step: [h, keys, values, then each chunk's keys and values], or None
        where the arrays are not the operation's. ``span`` > 1: one row's ``span`` tokens
        (a verify), each attending up to its own position."""
        ...


class Products(Protocol):
    """Linear layers' products of one input as the device computes them: each layer's
    ``linear(x)`` (``residual + linear(x)`` with one layer and a residual), or None where
    the layers were not adopted so (the forward calls each layer)."""

    def __call__(self, x: Any, linears: tuple[Any, ...], residual: Any = None
                 ) -> list[Any] | None: ...


class Forward(Protocol):
    """What the neutral forward needs of a device."""

    @property
    def decode_layer(self) -> DecodeLayer | None: ...

    @property
    def products(self) -> Products | None: ...


class Plug(Forward, Protocol):
    """What the engine needs of a device (and the facts ``/health`` reports)."""

    @property
    def kind(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def native(self) -> bool: ...

    @property
    def kernel(self) -> str | None: ...

    @property
    def fast_ops(self) -> bool: ...

    @property
    def quant(self) -> str | None: ...

    @property
    def heap(self) -> str: ...

    @property
    def fused_layer(self) -> bool: ...

    @property
    def degraded(self) -> tuple[str, ...]:
        """What makes this process slower than it could be, each with its fix."""
        ...

    @property
    def profile(self) -> CostProfile:
        """The cost model's priors and step rows for this device (the scheduler's)."""
        ...

    @property
    def look_ahead(self) -> bool:
        """Whether a tick's next step may be built while this one computes."""
        ...

    def adopt(self, model: Any) -> int:
        """Fit ``model`` to the device; the bytes this adds to the model's."""
        ...

    def describe(self) -> dict[str, Any]: ...


SHIPPED: dict[str, type[cpu.CpuPlug | metal.MetalPlug | cuda.CudaPlug]] = {
    "cpu": cpu.CpuPlug, "metal": metal.MetalPlug, "cuda": cuda.CudaPlug}
"""The plugs that ship, by kind (:data:`appliance.backend.KINDS`): each prepares the
process (``prepare``, before MLX loads) and starts itself (``start``)."""


def prepare(blas: str, kernel: bool, argv: list[str], data_dir: Path | None = None) -> None:
    """Before MLX is imported: prepare the process for the installed kind (on the CPU it
    may restart once with the wanted libraries preloaded; ``kernel``: skinny_matmul too),
    and say which BLAS it mapped. ``data_dir``: where the device keeps what it compiles
    (MLX's CUDA kernel cache); None keeps nothing."""
    SHIPPED[installed_kind()].prepare(blas, kernel, argv, data_dir)


def start(*, native: bool = True, fast_cpu_ops: bool = True) -> Plug:
    """The plug for the model about to load (the engine thread, once): the CPU's where MLX's
    default device is the CPU (with ``native``, its fast operations and malloc's
    thresholds), else the installed kind's, MLX as shipped. Logs one line saying what runs."""
    import mlx.core as mx

    kind = "cpu" if mx.default_device() == mx.cpu else installed_kind()
    if kind != "cpu":
        cpu.stand_down()  # a CPU plug started before in this process (tests) leaves MLX be
    plug = SHIPPED[kind].start(native=native, fast_cpu_ops=fast_cpu_ops)
    log.info("backend: kind=%s device=%s native=%s kernel=%s fast_ops=%s quant=%s "
             "fused_layer=%s heap=%s profile=%s", plug.kind, plug.device, plug.native,
             plug.kernel or "none", plug.fast_ops, plug.quant or "none", plug.fused_layer,
             plug.heap, plug.profile.name)
    return plug


def adopt(model: Any, plug: Plug) -> int:
    """Fit the loaded ``model`` to ``plug`` (what :func:`start` gave) and keep the plug on
    it for :func:`of`; the bytes this adds to the model's."""
    extra = plug.adopt(model)
    object.__setattr__(model, _ATTR, plug)
    return extra


def of(model: Any) -> Forward:
    """What the neutral forward asks ``model``'s device for: the plug that adopted it, else
    the CPU's forward (its kernels answer None for a model they did not adopt, and are
    never installed off the CPU)."""
    found: Forward | None = model.__dict__.get(_ATTR)
    return cpu.FORWARD if found is None else found


def held_bytes(model: Any, part: Any) -> int:
    """The bytes ``part`` (a module of ``model``; from the shapes) will hold once
    :func:`adopt` has fitted ``model`` to the plug :func:`start` gave (a machine of a group
    splits a model by them)."""
    return cpu.held_bytes(model, part)
