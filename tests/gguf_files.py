"""Small GGUF files written with llama.cpp's own ``gguf`` package, for the importer's tests:
a byte-level BPE vocabulary and random weights in the types and headers a test asks for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what byte-level BPE vocabularies hold)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K bytes (finite scales, random 6-bit sub-scales and nibbles)."""
    return random_blocks("Q4_K", rows, cols, rng)


HALVES = {"Q4_K": ((0, 0.002), (2, 0.001)), "Q5_K": ((0, 0.001), (2, 0.0005)),
          "Q6_K": ((208, 0.0003),), "IQ4_NL": ((0, 0.0005),), "IQ4_XS": ((0, 0.0002),),
          "Q3_K": ((108, 0.0005),), "Q2_K": ((80, 0.001), (82, 0.0005))}
"""Where each type's float16 super-scales sit in its block, and a value for them."""


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of ``kind`` with random codes and sub-scales and fixed float16 scales
    (random bytes there would be NaNs and infinities)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at, value in HALVES[kind]:
        blocks[:, at:at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def _half_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def k_blocks(x: np.ndarray, kind: str) -> np.ndarray:
    """Q4_K or Q5_K blocks of ``x`` (rows of multiples of 256), packed by hand from the
    format: per sub-block of 32 a 6-bit scale and min under the super-block's ``d`` and
    ``dmin``; ``w = d * sc * q - dmin * m``."""
    top = 15 if kind == "Q4_K" else 31
    sub = x.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    step = (sub.max(-1) - lo) / top
    d = np.maximum(step.max(-1), 1e-8) / 63
    dmin = np.maximum(-lo.min(-1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    scale, bias = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint((sub + bias) / scale), 0, top).astype(np.uint8)
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=-1)
    low = (q & 15).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    parts = [_half_bytes(d), _half_bytes(dmin), packed]
    if kind == "Q5_K":
        high = (q >> 4).astype(np.uint8)  # (n, 8, 32): bit j of byte l is sub-block j's
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(
            1, dtype=np.uint8))
    parts.append(nibbles)
    return np.concatenate(parts, axis=-1).reshape(x.shape[0], -1)


def q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``x``, packed by hand: 16 int8 scales of 16 weights under ``d``,
    6-bit codes around 32 split in low nibbles and high pairs."""
    sub = x.astype(np.float32).reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = (np.maximum(step.max(-1), 1e-8) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / d[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.rint(sub / (d[:, None] * sc)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # half, quarter, position
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1)
    qh = sum(((q[:, :, j] >> 4) << (2 * j)).astype(np.uint8) for j in range(4))
    return np.concatenate([ql.reshape(-1, 128), np.asarray(qh).reshape(-1, 64),
                           sc.view(np.uint8), _half_bytes(d)], axis=-1).reshape(x.shape[0], -1)


def iq4_nl_blocks(x: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of ``x``: per 32 weights a float16 scale and indices into llama.cpp's
    16 non-linear values."""
    from gguf.quants import IQ4_NL

    table = np.array(IQ4_NL.kvalues, np.float32)
    blk = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(blk).max(-1) / 127).astype(np.float16).astype(np.float32)
    safe = np.where(d == 0, 1, d)[:, None]
    idx = np.abs(blk[..., None] / safe[..., None] - table).argmin(-1).astype(np.uint8)
    return np.concatenate([_half_bytes(d), idx[:, :16] | (idx[:, 16:] << 4)],
                          axis=-1).reshape(x.shape[0], -1)


def blocks_of(x: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """``x`` as GGUF blocks of ``kind``: gguf-py's quantizers where it has one, packed by
    hand here for Q4_K, Q5_K, Q6_K and IQ4_NL; random valid blocks for the others."""
    from gguf import GGMLQuantizationType, quants

    if kind in ("Q4_K", "Q5_K"):
        return k_blocks(x, kind)
    if kind == "Q6_K":
        return q6_k_blocks(x)
    if kind == "IQ4_NL":
        return iq4_nl_blocks(x)
    if kind in HALVES:
        return random_blocks(kind, x.shape[0], x.shape[1], rng)
    return np.asarray(quants.quantize(x, GGMLQuantizationType[kind]))


def write_gguf(path: Path, *, arch: str = "llama", quant: str = "Q8_0", hidden: int = 256,
               layers: int = 2, seed: int = 0, rope_freqs: np.ndarray | None = None,
               vocab: str = "gpt2", vision: bool = False, pre: str | None = None,
               quant_of: Callable[[str], str] | None = None) -> Path:
    """A tiny model: ``quant`` is Q8_0, Q4_0 or Q4_K for its matrices (norms stay F32,
    random around 1 as a trained model's are). ``arch`` llama, qwen3, gemma3 (its four norms
    per block, query and key norms, sliding window of 8, every second layer global: the file
    says so) or phi3 (fused ``attn_qkv`` and ``ffn_up``, its own output matrix);
    ``rope_freqs``: Llama 3.x's per-frequency RoPE factors, as llama.cpp stores them.
    ``vocab``: ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece: byte fallback tokens,
    scores, no merges, as Gemma's and Phi-3's files have it). ``vision``: a vision tower's
    and projector's tensors beside the text model, as Ollama's Gemma 3 file has them.
    ``pre``: ``tokenizer.ggml.pre`` (how text is split before the merges), with two digit
    merges that tell the splits apart ("3 4" before "1 2"). ``quant_of``: each matrix's type by
    its name, instead of ``quant`` (any type :func:`blocks_of` writes)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    heads, kv_heads, ffn = 4, 2, 2 * hidden
    head_dim = hidden // heads
    if vocab == "llama":
        specials = ["<unk>", "<s>", "</s>", "<pad>", "<mask>", "<start_of_turn>",
                    "<end_of_turn>"]
        pieces = ["\u2581", "t", "h", "e", "a", "\u2581t", "he", "\u2581the", "\u2581a"]
        tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
        types = [2] + [3] * (len(specials) - 1) + [6] * 256 + [1] * len(pieces)
        scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(1, len(pieces) + 1)]
    else:
        tokens = [*SPECIALS, *byte_chars(), "Ġt", "he", *(["34", "12"] if pre else [])]
        types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_tokenizer_model(vocab)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if vocab == "llama":
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(3)
        w.add_add_space_prefix(arch != "gemma3")
    else:
        w.add_token_merges(["Ġ t", "h e", *(["3 4", "1 2"] if pre else [])])
        if pre:
            w.add_tokenizer_pre(pre)
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    if arch == "gemma3":
        w.add_sliding_window(8)
        w.add_sliding_window_pattern(2)
        w.add_value_length(head_dim)

    def matrix(name: str, rows: int, cols: int) -> None:
        kind = quant_of(name) if quant_of else quant
        if kind == "Q4_K" and quant_of is None:
            w.add_tensor(name, q4_k_blocks(rows, cols, rng), raw_dtype=T.Q4_K)
            return
        x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(name, blocks_of(x, kind, rng), raw_dtype=T[kind])

    def norm(name: str, size: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), hidden)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    kv = kv_heads * head_dim
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        if arch == "phi3":
            matrix(f"blk.{i}.attn_qkv.weight", hidden + 2 * kv, hidden)
        else:
            matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
            matrix(f"blk.{i}.attn_k.weight", kv, hidden)
            matrix(f"blk.{i}.attn_v.weight", kv, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        if arch in ("qwen3", "gemma3"):
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        if arch == "gemma3":
            norm(f"blk.{i}.post_attention_norm.weight", hidden)
            norm(f"blk.{i}.post_ffw_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        if arch == "phi3":
            matrix(f"blk.{i}.ffn_up.weight", 2 * ffn, hidden)
        else:
            matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
            matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    norm("output_norm.weight", hidden)
    if vision:
        w.add_tensor("v.blk.0.attn_q.weight", np.zeros((64, 64), np.float16))
        w.add_tensor("mm.input_projection.weight", np.zeros((64, hidden), np.float32))
    if arch == "phi3":
        matrix("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ollama_store(root: Path, name: str = "tiny", tag: str = "q8") -> Path:
    """An Ollama store as Ollama keeps one under ~/.ollama/models, with one model: its
    manifest names a template layer and the model layer, a small GGUF (:func:`write_gguf`)."""
    import json

    blob = root / "blobs" / "sha256-0123abcd"
    blob.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(blob, quant="Q8_0")
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256-ffff"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:0123abcd"}]}))
    return root


CRAFTED = ("tensor-count", "kv-count", "string-length", "offset", "dims")
"""Damage to a GGUF file's header and tensor table of the kinds that crashed MLX's C
parser (SIGSEGV, SIGABRT) where Python's parser raises."""


def craft(path: Path, damage: str) -> None:
    """``path`` (a :func:`write_gguf` file) damaged in place as ``damage`` says."""
    import struct

    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)  # its tensor info: n_dims, dims, type, offset
    n_dims = struct.unpack_from("<I", data, at)[0]
    if damage == "tensor-count":
        struct.pack_into("<Q", data, 8, 1 << 40)
    elif damage == "kv-count":
        struct.pack_into("<Q", data, 16, 1 << 40)
    elif damage == "offset":
        struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, len(data) * 4)
    elif damage == "dims":
        struct.pack_into("<Q", data, at + 4, 1 << 62)
    elif damage == "string-length":  # the length of the first key's name
        struct.pack_into("<Q", data, 24, 1 << 60)
    path.write_bytes(bytes(data))


def q4_k_m_like(source: Path, path: Path, preset: str = "Q4_K_M") -> Path:
    """``source`` (a GGUF file) as llama.cpp's ``llama-quantize ... Q4_K_M`` (or ``Q5_K_M``)
    writes it, from its dequantized values: Q4_K (Q5_K), or Q6_K for ``ffn_down`` and
    ``attn_v`` in the layers llama.cpp gives more bits and for the output (the embeddings
    where they are tied); rows that are not multiples of 256 fall back as llama.cpp's do
    (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Metadata copied as it is."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, quants

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    w = gguf.GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), main, sub_type=sub)

    def more_bits(i: int) -> bool:  # llama.cpp's use_more_bits
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    rng = np.random.default_rng(0)
    for t in reader.tensors:
        if t.tensor_type.name in ("F32", "F16"):
            w.add_tensor(t.name, np.array(t.data))
            continue
        values = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        parts = t.name.split(".")
        wide = (t.name == "output.weight" or (tied and t.name == "token_embd.weight")
                or (parts[0] == "blk" and parts[2] in ("ffn_down", "attn_v")
                    and more_bits(int(parts[1]))))
        base, fallback = {"Q4_K_M": ("Q4_K", "Q5_0"), "Q5_K_M": ("Q5_K", "Q5_1")}[preset]
        if values.shape[-1] % 256:
            kind = "Q8_0" if wide else fallback
        else:
            kind = "Q6_K" if wide else base
        w.add_tensor(t.name, blocks_of(values, kind, rng),
                     raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
