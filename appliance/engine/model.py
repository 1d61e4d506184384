"""Loading a model through ``mlx_lm.load`` and the facts the rest of the daemon needs."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.engine import chat_template

if TYPE_CHECKING:
    from appliance.backend.plug import Plug

log = logging.getLogger(__name__)

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEFAULT_IMPORTED = "smollm2-135m-instruct"
"""The models folder's entry served when no model is set: the real instruct model install.sh
imports (``appliance model import smollm2``); without it, the demo model."""


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    """mlx-lm's TokenizerWrapper (HF tokenizer + streaming detokenizer + eos ids)."""
    name: str
    path: Path
    is_demo: bool
    ctx_limit: int
    kv_bytes_per_token: int
    kv_dtype: str
    """What the KV cache is kept in ("float16" on the CPU for a quantized model,
    appliance/engine/kvcache.py; else the model's activations' dtype)."""
    weight_bytes: int
    config: dict[str, Any]
    backend: Plug
    """The device's plug (appliance/backend/plug.py), which adopted ``model``."""

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)


def resolve_model_path(model: str, models_dir: Path) -> Path:
    """Empty -> the imported SmolLM2 if there is one, else the bundled demo; "demo" -> the
    demo; a directory -> itself; a repo id or an imported name -> its folder."""
    if not model:
        imported = models_dir / DEFAULT_IMPORTED
        return imported if (imported / "config.json").is_file() else DEMO_MODEL_DIR
    if model == "demo":
        return DEMO_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    pulled = models_dir / model.replace("/", "--")
    if pulled.is_dir():
        return pulled
    raise FileNotFoundError(
        f"model {model!r} is neither a directory nor a pulled model in {models_dir}; "
        f"run 'appliance model pull {model}' first")


def kv_bytes_per_token(config: dict[str, Any], dtype_size: int) -> int:
    """layers x KV heads x head dim x 2 (K and V) x dtype size."""
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    return layers * kv_heads * head_dim * 2 * dtype_size


def load_model(path: Path, ctx_size: int = 0, *, fast_cpu_ops: bool = False,
               native: bool = True, layers: tuple[int, int] | None = None, edges: bool = True,
               split: Callable[[Any], tuple[int, int] | None] | None = None) -> LoadedModel:
    """Start the device's plug (appliance/backend/plug.py: ``native`` code and ``fast_cpu_ops`` where MLX
    runs on the CPU; a process-wide switch, logged), then load the model.

    A machine of a group (appliance/distributed) loads only its ``layers`` ``[lo, hi)``,
    and without ``edges`` no embedding, final norm or head: the weights are read lazily
    and only the kept ones are ever evaluated. ``split`` chooses the layers from the
    unloaded model (None: all of them)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from appliance.backend import plug
    from appliance.engine.kvcache import kv_dtype

    backend = plug.start(native=native, fast_cpu_ops=fast_cpu_ops)
    staged = layers is not None or split is not None
    loaded: Any = load(str(path), lazy=staged)
    model, tokenizer = loaded[0], loaded[1]
    # a template that loops would hang every request: refused now, with the reason
    chat_template.probe(tokenizer, path)
    if split is not None:
        layers = split(model)
    if layers is not None or not edges:
        lo, hi = layers if layers is not None else (0, len(model.model.layers))
        slice_layers(model, lo, hi, edges=edges)
    if staged:
        mx.eval(model.parameters())
    extra = plug.adopt(model, backend)
    config = json.loads((path / "config.json").read_text())
    flat: Any = tree_flatten(model.parameters())
    named: list[tuple[str, Any]] = list(flat)
    weight_bytes = sum(v.nbytes for _, v in named) + extra
    # the activations' dtype (and the KV cache's): a norm's or a plain weight's, not a
    # quantized layer's scales (left 16-bit on the CPU) or its packed integers
    dtype = next((v.dtype for name, v in named if mx.issubdtype(v.dtype, mx.floating)
                  and not name.endswith((".scales", ".biases"))), mx.float32)
    kv = kv_dtype(model) or dtype
    dtype_size = 2 if kv in (mx.bfloat16, mx.float16) else 4
    model_limit = int(config.get("max_position_embeddings")
                      or config.get("text_config", {}).get("max_position_embeddings") or 4096)
    ctx_limit = ctx_size or model_limit
    name = config.get("appliance_name") or path.name
    loaded = LoadedModel(
        model=model, tokenizer=tokenizer, name=name, path=path,
        is_demo=bool(config.get("appliance_demo")), ctx_limit=ctx_limit,
        kv_bytes_per_token=kv_bytes_per_token(config, dtype_size),
        kv_dtype=str(kv).removeprefix("mlx.core."), weight_bytes=weight_bytes,
        config=config, backend=backend)
    log.info("model loaded: path=%s weights=%d bytes ctx=%d kv_per_token=%d kv=%s demo=%s",
             path, weight_bytes, ctx_limit, loaded.kv_bytes_per_token, loaded.kv_dtype,
             loaded.is_demo)
    return loaded


def slice_layers(model: Any, lo: int, hi: int, *, edges: bool) -> None:
    """Keep layers ``[lo, hi)`` of ``model`` (an mlx-lm model, weights not yet evaluated);
    without ``edges`` drop the embedding, the final norm and the head too, so their weights
    are never read from disk."""
    inner = model.model
    inner.layers = inner.layers[lo:hi]
    if not edges:
        for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head")):
            if name in owner:
                del owner[name]


def hidden_dtype(model: Any) -> Any:
    """The dtype of the hidden states (what the embedding yields)."""
    import mlx.core as mx

    return model.model.embed_tokens(mx.array([0])).dtype


def param_bytes(module: Any) -> int:
    """Bytes of a module's parameters, from their shapes (nothing need be loaded)."""
    from mlx.utils import tree_flatten

    params: list[Any] = [kv[1] for kv in tree_flatten(module.parameters())]
    return sum(int(v.nbytes) for v in params)
