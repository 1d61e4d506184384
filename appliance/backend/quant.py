"""MLX's affine-quantized matrix product on the CPU, from the kernel of
appliance/backend/native/quant_matmul.cpp (see its header for why: MLX's own CPU kernel
unpacks the weights once per row, so a decode step of 8 rows costs 8 of one).

:func:`install` puts :func:`quantized_matmul` in place of ``mlx.core.quantized_matmul``,
which ``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding.as_linear`` look up at each call,
when MLX's default device is the CPU: a switch for the whole process, which
:func:`uninstall` turns back. Anything the kernel does not take (another mode, no biases,
``transpose=False``, activations that are not float32, other bit widths or group sizes, an
explicit stream) goes to MLX's own function unchanged.

Products of more than :data:`KERNEL_ROWS` rows (a prompt's) take another path: the weights
dequantized into float32 by the extension, then MLX's matmul (OpenBLAS's sgemm where the
daemon preloads it), which blocks for the cache where the kernel reads the weights once per
few rows. Up to :data:`KERNEL_ROWS` rows a row's sums are the kernel's, in a fixed order
whatever its neighbours: a decode step, and one with small prompt chunks riding in it, gives
each row the same bits alone and in a batch.

:func:`adopt` takes a loaded model's layers into the kernel's own forms: 4- and 8-bit
weights as tiles of 16 columns (appliance/backend/tiles.py), which a product of few rows reads at the memory's
pace, and the products a module takes of one x one after another (q, k and v; gate and up:
:data:`SIBLINGS`) made one operation: the first of them computes all, the others take their
outputs. Each product costs a fixed part beyond its weights (a scheduled operation, x
rounded, the threads' hand-off), and a decode step of SmolLM2 had 210 of them.

Held once (``adopt(model, hold=True)``, as each group is tiled; :func:`hold_once` after
adopting), a tiled layer's MLX arrays are freed: the tiles are its only copy, which
a prompt's products dequantize (``dequantize_tiled``) and a tied embedding's lookup reads
(docs/decisions/weights-held-once.md).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

import appliance.backend.fast_ops as fast_ops
from appliance.backend.tiles import Tiled, lookup, narrowed, tile, untile

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ACTIVATIONS = ("float", "int16")  # the kernel's codes 0 and 1
PATHS = ("kernel", "dense")
KERNEL_ROWS = 32
"""The most rows the kernel takes; more go dense. Not below 32: the fixed-order promise
(appliance/engine/mixed.py) holds to 32 rows, as for skinny_matmul's fp32 products. Dense was
faster from 33 rows up on SmolLM2's layers (docs/decisions.md)."""
TILED_ROWS = 4096
"""The most rows a tiled layer's product takes from its tiles (a prompt's chunk is at most
2,048 tokens); more go dense. Each row's sums are in a fixed order at any count. On a Zen 4
(2 threads) the tiles were faster than dense at every count from 64 to 2,048 rows: the 1B
shape's gate and up 283 against 441 us a row at 2,048, its 8-bit down 247 against 383;
SmolLM2's layers as fast or faster (at 256 rows once the limit: 26 against 38 us)."""
DENSE_WHOLE = 1 << 20
"""Weights of at most this many elements (4 MiB dequantized) are dequantized whole for the
dense path; bigger ones in pieces of rows of at most :data:`DENSE_PIECE`, which the gemm
reads back from the cache (SmolLM2's 49152 x 576 output layer at 64 rows, one thread: 108 ms
whole, 79 in pieces; docs/decisions.md)."""
DENSE_PIECE = 1 << 18

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Layers of a module that mlx-lm's attention and MLPs call on the same x in turn."""

_original: list[Any] = []
_switch_activations: list[str | None] = []
"""What :func:`install` was told about activations (None: the process's choice)."""


class _Layer(NamedTuple):
    """An adopted quantized layer: MLX's arrays (empty ones once :func:`hold_once` freed
    them), and its tiles when it has them."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int
    tiled: Tiled | None
    module: Any = None
    """The layer itself, where :func:`hold_once` freed its arrays (to put them back)."""
    dtype: Any = None
    """Its scales' dtype before they were narrowed in the tiles (an embedding's)."""


class _Group(NamedTuple):
    """Sibling layers (or one layer alone), with the kernel's arguments for them all."""

    layers: tuple[_Layer, ...]
    args: tuple[Any, ...]
    """The extension's arguments after x: tiled_matmul's where tiled, else
    quantized_matmul_many's but for the activations."""


_layers: dict[int, tuple[_Group, int]] = {}
"""id of an adopted layer's weight -> (its group, or itself alone; its index). The entries
hold the arrays, so an id is never reused while here."""
_freed = [0]
"""Bytes of MLX's arrays freed since the last :func:`adopt`."""
_pending = threading.local()
"""The last group product on this thread: (x, group, outputs not yet taken)."""


def available() -> str | None:
    """None when the kernel can be used here, else why not (it ships in the fast ops'
    extension and is refused with it)."""
    why = fast_ops.available()
    if why is not None:
        return why
    if not hasattr(fast_ops._extension(), "quantized_matmul"):
        return "appliance.backend._mlx_fast has no quantized kernel (reinstall the appliance)"
    return None


def installed() -> bool:
    return bool(_original)


def simd() -> str | None:
    """The instruction set the kernel runs when it is installed, else None."""
    return str(fast_ops._extension().quant_simd()) if _original else None


def install(activations: str | None = None) -> str | None:
    """Use the kernel for MLX's quantized products, 4-bit ones taking x as ``activations``
    says (None: :func:`activations`); None when done, else why not."""
    if _original:
        return None
    why = available()
    if why is not None:
        return why
    _original.append(mx.quantized_matmul)
    _switch_activations[:] = [activations]
    mx.quantized_matmul = _quantized_matmul_with(mx.quantized_matmul, activations)
    return None


def uninstall() -> None:
    """Put MLX's own function back."""
    if _original:
        mx.quantized_matmul = _original.pop()
    adopt(None)


def adopt(model: Any, hold: bool = False) -> tuple[int, int]:
    """Take ``model``'s quantized layers into the kernel's own forms while it is installed,
    forgetting any other model's: 4- and 8-bit weights as tiles where x is rounded to 16
    bits (:func:`tile`), and sibling layers (:data:`SIBLINGS`: quantized alike, one input width) grouped, so that the first
    call of a group computes all its products. The groups, and the bytes the tiles take
    (beside MLX's arrays, until :func:`hold_once`; with ``hold``, each group's arrays are
    freed as soon as its tiles exist, so loading never holds the model twice:
    :func:`freed_bytes`). None forgets them all (a layer whose arrays were freed gets them
    back from its tiles)."""
    _restore()
    _layers.clear()
    _pending.__dict__.clear()
    _freed[0] = 0
    if model is None or not _original:
        return 0, 0
    tiling = _tiling()
    owners = _owners(model) if hold and holds_once() else None
    grouped: set[int] = set()
    groups = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            members: list[Any] = [module.get(name) for name in names]
            if not members or not all(_fusable(m, members[0]) for m in members):
                continue
            group = _held_now(_group([_adopt_layer(m, tiling) for m in members]), owners)
            for index, m in enumerate(members):
                _layers[id(m["weight"])] = (group, index)
                grouped.add(id(m))
            groups += 1
    # every other layer, and an embedding that is also the output layer (its as_linear makes
    # the same call with its own arrays; one that is not would never be read), 8-bit ones
    # too: tiles take x in 16 bits, two elements a multiply-add, where the float kernel
    # takes one (a Q4_K_M file's 8-bit down_proj took 0.48 ms a prompt token on the 1B
    # shape, against 0.16 for its 4-bit ones), and the fused decode layer takes only tiles
    tied = model.get("lm_head") is None
    for _, module in model.named_modules():
        if (id(module) not in grouped and _fusable(module, module) and tiling
                and (tied or not isinstance(module, nn.QuantizedEmbedding))):
            group = _held_now(_group([_adopt_layer(module, tiling)]), owners)
            _layers[id(module["weight"])] = (group, 0)
    return groups, tiled_bytes()


def freed_bytes() -> int:
    """The bytes of MLX's arrays freed since the last :func:`adopt` (its ``hold`` and
    :func:`hold_once`)."""
    return _freed[0]


def _owners(model: Any) -> dict[int, Any]:
    """id of each quantized module's weight -> the module."""
    return {id(m["weight"]): m for _, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def _held_now(group: _Group, owners: dict[int, Any] | None) -> _Group:
    """``group`` held once right away where ``owners`` is given (and it can be), MLX's
    cache of the freed buffers emptied into the heap at once, so the next group's tiles and
    temporaries reuse that memory rather than add to the peak."""
    if owners is None:
        return group
    freed, held = _hold(group, owners)
    if freed:
        mx.clear_cache()
    return held


def _hold(group: _Group, owners: dict[int, Any]) -> tuple[int, _Group]:
    """``group`` with its layers' arrays freed where all are tiled, owned by ``owners``'
    modules and not yet freed, and the bytes freed; else (0, ``group``)."""
    if any(layer.tiled is None or layer.module is not None or id(layer.w) not in owners
           for layer in group.layers):
        return 0, group
    freed = sum(x.nbytes for layer in group.layers for x in (layer.w, layer.scales, layer.biases))
    _freed[0] += freed
    return freed, _held_group(group, [owners[id(layer.w)] for layer in group.layers])


def tiled_bytes() -> int:
    """The bytes the adopted layers' tiles take."""
    return sum(t.tiles.nbytes + t.scales.nbytes + t.biases.nbytes
               for group, index in _layers.values() if (t := group.layers[index].tiled))


def _tiling() -> bool:
    return bool(_original) and (_switch_activations[0] or activations()) == "int16"


def tiled_nbytes(module: Any, tied: bool, scale_size: int) -> int:
    """The bytes :func:`adopt` will add beside ``module``'s arrays (its tiles; 0: none),
    from its shapes (its weights need not be loaded); ``tied``: the model's embedding is
    also its output layer; ``scale_size``: its scales' element size once adopted."""
    if not (_tiling() and _fusable(module, module) and (
            tied or not isinstance(module, nn.QuantizedEmbedding))):
        return 0
    w, scales = module["weight"], module["scales"]
    rows = -(-w.shape[0] // 16) * 16  # whole tiles of 16 columns
    return rows * (w.shape[1] * w.itemsize + 2 * scales.shape[1] * scale_size)


def _group(layers: list[_Layer]) -> _Group:
    tiles = [layer.tiled for layer in layers if layer.tiled is not None]
    if tiles:
        args: tuple[Any, ...] = ([t.tiles for t in tiles], [t.scales for t in tiles],
                                 [t.biases for t in tiles], [t.n for t in tiles],
                                 tiles[0].group_size)
    else:
        args = ([layer.w for layer in layers], [layer.scales for layer in layers],
                [layer.biases for layer in layers], layers[0].group_size, layers[0].bits)
    return _Group(tuple(layers), args)


def _adopt_layer(layer: Any, tiling: bool) -> _Layer:
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    tiled = tile(w, scales, biases, layer.group_size) if tiling else None
    if tiled is not None:
        mx.eval(*tiled[:3])
    return _Layer(w, scales, biases, layer.group_size, layer.bits, tiled)


def _fusable(layer: Any, first: Any) -> bool:
    return (isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and layer.mode == "affine"
            and "biases" in layer and layer.bits in BITS and layer.group_size in GROUP_SIZES
            and layer.bits == first.bits and layer.group_size == first.group_size
            and layer["scales"].dtype == first["scales"].dtype
            and layer["weight"].shape[1] == first["weight"].shape[1])


def _adopted(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
             activations: str | None) -> mx.array | None:
    """w's product with x in the adopted form: by tiles, or as one of its group's (the
    pending output where the group was just computed for this x); None where w was not
    adopted, or x has more rows than the form takes (:data:`TILED_ROWS`,
    :data:`KERNEL_ROWS`)."""
    entry = _layers.get(id(w))
    if entry is None:
        return None
    group, index = entry
    layer = group.layers[index]
    if layer.scales is not scales or layer.biases is not biases:
        return None
    if not _fits(layer, x):
        # a layer held once has no other copy: a prompt's rows go dense from its tiles
        return None if layer.module is None or layer.tiled is None else \
            _dense_tiled(fast_ops._extension(), x, layer.tiled)
    pending = getattr(_pending, "last", None)
    if pending is not None and pending[0] is x and pending[1] is group:
        out = pending[2][index]
        if out is not None:
            pending[2][index] = None
            return out
    computed = _compute(group, x, activations)
    if computed is None:
        return None
    out = computed[index]
    if len(computed) > 1:
        outs: list[mx.array | None] = list(computed)
        outs[index] = None
        _pending.last = (x, group, outs)
    return out


def _fits(layer: _Layer, x: mx.array) -> bool:
    """Whether the adopted form takes x's rows (:data:`TILED_ROWS`, :data:`KERNEL_ROWS`)."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    return rows <= (TILED_ROWS if layer.tiled is not None else KERNEL_ROWS)


def _compute(group: _Group, x: mx.array, activations: str | None,
             residual: mx.array | None = None) -> list[mx.array] | None:
    """Every product of ``group`` with x, as one operation; None for a lone layer that is
    not tiled (MLX's call of it takes the kernel's plain path). ``residual``: added to a
    lone tiled layer's output in the same operation."""
    ext = fast_ops._extension()
    if group.layers[0].tiled is not None:
        return list(ext.tiled_matmul(x, *group.args, residual, group.layers[0].bits))
    if residual is not None:
        return None
    if len(group.layers) > 1:
        act = -1 if activations is None else ACTIVATIONS.index(activations)
        return list(ext.quantized_matmul_many(x, *group.args, act))
    return None


def products(x: mx.array, linears: tuple[Any, ...], residual: mx.array | None = None
             ) -> list[mx.array] | None:
    """Each of ``linears``' products with a float32 ``x`` [rows, K], as their module's calls
    would give them (the same operation), where the layers were adopted as one group in
    this order (q/k/v, gate/up: :data:`SIBLINGS`) or one tiled layer; else None, and the
    caller calls each layer. For a forward that knows its siblings: one call, where each
    layer's own goes through ``nn.QuantizedLinear`` and the switch, which adds a layer's own
    ``bias`` (Qwen 2's q/k/v) after the product, as here. ``residual`` (one tiled layer
    with no bias): ``residual + linear(x)``, bit for bit, in the product's own operation."""
    if not _original or x.dtype != mx.float32 or (
            residual is not None and (len(linears) != 1 or residual.dtype != mx.float32
                                      or "bias" in linears[0])):
        return None
    group = _group_of(linears)
    if group is None or not _fits(group.layers[0], x):
        return None
    outs = _compute(group, x, _switch_activations[0], residual)
    if outs is None:
        return None
    return [out + linear["bias"] if "bias" in linear else out
            for out, linear in zip(outs, linears, strict=True)]


def _group_of(linears: tuple[Any, ...]) -> _Group | None:
    """The adopted group that is exactly ``linears``, in this order, or None."""
    entry = _layers.get(id(linears[0]["weight"]))
    if entry is None or entry[1] != 0:
        return None
    group = entry[0]
    if len(group.layers) != len(linears):
        return None
    for layer, linear in zip(group.layers, linears, strict=True):
        if (layer.w is not linear["weight"] or layer.scales is not linear["scales"]
                or layer.biases is not linear["biases"]):
            return None
    return group


def tiled_args(linears: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``tiled_matmul``'s arguments after x (tiles, scales, biases, n's, group size) for
    ``linears`` where the kernel adopted them as one group of tiled layers, in this order
    (:data:`SIBLINGS`, or one layer); else None."""
    group = _group_of(linears) if _original else None
    if group is None or group.layers[0].tiled is None:
        return None
    return group.args


def holds_once() -> bool:
    """Whether :func:`hold_once` can free adopted layers' arrays here: the extension
    dequantizes a prompt's products from the tiles."""
    return _tiling() and hasattr(fast_ops._extension(), "dequantize_tiled")


def hold_once(model: Any) -> int:
    """Free the arrays of ``model``'s tiled layers (:func:`adopt` made their tiles), so the
    tiles are their only copy: every product reads them (a prompt's through
    ``dequantize_tiled``, to the same floats), and a tied embedding looks its rows up in
    them (:class:`_HeldEmbedding`), its scales back in the 16 bits they were stored in where
    :func:`~appliance.backend.cpu.float32_on_cpu` widened them. Each freed array becomes an
    empty one of its dtype and rows, so nothing keeps it. The bytes freed."""
    if not holds_once():
        return 0
    owners = _owners(model)
    freed = 0
    for group in {id(g): g for g, _ in _layers.values()}.values():
        bytes_, held = _hold(group, owners)
        if not bytes_:
            continue
        freed += bytes_
        for index, (old, new) in enumerate(zip(group.layers, held.layers, strict=True)):
            del _layers[id(old.w)]
            _layers[id(new.w)] = (held, index)
    return freed


def _held_group(group: _Group, modules: list[Any]) -> _Group:
    """``group`` with each layer's arrays freed (its module's replaced by empty ones)."""
    layers = []
    for layer, module in zip(group.layers, modules, strict=True):
        assert layer.tiled is not None
        tiled, dtype = layer.tiled, layer.scales.dtype
        if isinstance(module, nn.QuantizedEmbedding):
            tiled = narrowed(tiled)
            module.__class__ = _HeldEmbedding
        empty = {name: mx.zeros((module[name].shape[0], 0), module[name].dtype)
                 for name in ("weight", "scales", "biases")}
        module.update(empty)
        layers.append(_Layer(empty["weight"], empty["scales"], empty["biases"],
                             layer.group_size, layer.bits, tiled, module, dtype))
    return _group(layers)


def _restore() -> None:
    """Put back the arrays :func:`hold_once` freed (from the tiles, computed when first
    read), before the layers are forgotten: a model used after that takes MLX's own
    products again."""
    for group, index in list(_layers.values()):
        layer = group.layers[index]
        if layer.module is None or layer.tiled is None:
            continue
        w, scales, biases = untile(layer.tiled)
        dtype = layer.dtype or scales.dtype
        module: Any = layer.module
        embedding = isinstance(module, _HeldEmbedding)
        if embedding:
            module.__class__ = nn.QuantizedEmbedding
        module.update({"weight": w, "scales": scales.astype(dtype),
                             "biases": biases.astype(dtype)})


class _HeldEmbedding(nn.QuantizedEmbedding):
    """A tied quantized embedding whose tiles are its only copy (:func:`hold_once`): rows
    looked up in them; ``as_linear`` is MLX's, which the switch answers from them."""

    def __call__(self, x: mx.array) -> mx.array:
        entry = _layers.get(id(self["weight"]))
        assert entry is not None, "a held embedding's tiles were forgotten"
        layer = entry[0].layers[entry[1]]
        assert layer.tiled is not None
        return lookup(layer.tiled, x, self.group_size, layer.dtype)


def mlx_own() -> Any:
    """MLX's own ``mx.quantized_matmul`` (the one the switch passes on to, or in place)."""
    return _original[0] if _original else mx.quantized_matmul


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int, activations: str | None = None,
                     path: str | None = None) -> mx.array:
    """``x @ mx.dequantize(w, scales, biases, group_size, bits).T`` for a float32 ``x``.
    ``path``: ``"kernel"`` (each output summed in a fixed order whatever the rows beside it),
    ``"dense"`` (dequantized weights into MLX's matmul, x in float) or None, the kernel for
    at most :data:`KERNEL_ROWS` rows, else dense. ``activations``: how the kernel takes a
    4-bit product's ``x``, ``"int16"`` (rounded per block of 32) or ``"float"``; None takes
    the process's choice (:func:`activations`)."""
    ext = fast_ops._extension()
    assert ext is not None
    k = x.shape[-1]
    rows = x.size // k if k else 0
    if path == "dense" or (path is None and rows > KERNEL_ROWS):
        return _dense(ext, x, w, scales, biases, group_size, bits)
    act = -1 if activations is None else ACTIVATIONS.index(activations)
    return ext.quantized_matmul(x, w, scales, biases, group_size, bits, act)


def _dense(ext: Any, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
           group_size: int, bits: int) -> mx.array:
    """The dense path: x's columns in the dequantized weights' block order (the kernel's),
    then a matmul per piece of the weights (:data:`DENSE_WHOLE`)."""
    xb = ext.block_order(x, bits)
    n, k = w.shape[0], x.shape[-1]
    step = n if n * k <= DENSE_WHOLE else max(1, DENSE_PIECE // k)
    parts = [mx.matmul(xb, ext.dequantize_blocked(w[i:i + step], scales[i:i + step],
                                                  biases[i:i + step], group_size, bits).T)
             for i in range(0, n, step)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _dense_tiled(ext: Any, x: mx.array, t: Tiled) -> mx.array:
    """:func:`_dense` for a tiled weight: the same pieces, dequantized from the tiles to the
    same floats (``dequantize_tiled``), so the same sums."""
    xb = ext.block_order(x, t.bits)
    n, k = t.n, x.shape[-1]
    step = n if n * k <= DENSE_WHOLE else max(1, DENSE_PIECE // k)
    parts = [mx.matmul(xb, ext.dequantize_tiled(t.tiles, t.scales, t.biases, i,
                                                min(step, n - i), t.group_size, t.bits).T)
             for i in range(0, n, step)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def activations() -> str:
    """How products take x unless told: ``"int16"`` on the AVX2 and AVX-512 variants (4- and
    8-bit layers tiled), ``"float"`` on the portable one; ``APPLIANCE_QUANT_ACT=float`` or
    ``int16`` overrides (an 8-bit layer the tiles do not hold takes x in float)."""
    return str(fast_ops._extension().quant_activations())


def takes(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
          transpose: bool, group_size: int | None, bits: int | None, mode: str) -> bool:
    """Whether the kernel computes this product (else MLX's own function does)."""
    return (mode == "affine" and transpose and biases is not None and bits in BITS
            and group_size in GROUP_SIZES and x.dtype == mx.float32 and w.dtype == mx.uint32
            and w.ndim == 2 and x.ndim >= 1 and scales.dtype in SCALE_DTYPES
            and biases.dtype == scales.dtype and x.shape[-1] * bits == w.shape[1] * 32
            and tuple(scales.shape) == (w.shape[0], x.shape[-1] // group_size)
            and tuple(biases.shape) == tuple(scales.shape))


def _held(w: mx.array) -> bool:
    entry = _layers.get(id(w))
    return entry is not None and entry[0].layers[entry[1]].module is not None


def _quantized_matmul_with(fallback: Any, activations: str | None) -> Any:
    def fast_quantized_matmul(x: mx.array, w: mx.array, /, scales: mx.array,
                              biases: mx.array | None = None, transpose: bool = True,
                              group_size: int | None = None, bits: int | None = None,
                              mode: str = "affine", *, stream: Any = None) -> mx.array:
        if (stream is None and _layers and biases is not None and transpose
                and x.dtype != mx.float32 and _held(w)):
            # a held layer has no other copy: its product in float32, as x's dtype
            return fast_quantized_matmul(x.astype(mx.float32), w, scales, biases, transpose,
                                         group_size, bits, mode).astype(x.dtype)
        if (stream is None and _layers and biases is not None and transpose
                and x.dtype == mx.float32):
            # an adopted layer's own arrays: their checks were made when it was adopted
            done = _adopted(x, w, scales, biases, activations)
            if done is not None:
                return done
        if stream is None and takes(x, w, scales, biases, transpose, group_size, bits, mode):
            assert biases is not None and group_size is not None and bits is not None
            return quantized_matmul(x, w, scales, biases, group_size, bits, activations)
        return fallback(x, w, scales=scales, biases=biases, transpose=transpose,
                        group_size=group_size, bits=bits, mode=mode, stream=stream)
    return fast_quantized_matmul
