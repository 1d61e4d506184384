"""Small GGUF files written with llama.cpp's own ``gguf`` package, for the importer's tests:
a byte-level BPE vocabulary and random weights in the types and headers a test asks for."""

from __future__ import annotations

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
    from gguf import GGMLQuantizationType

    assert GGMLQuantizationType.Q4_K and cols % 256 == 0
    blocks = np.zeros((rows * cols // 256, 144), np.uint8)
    blocks[:, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    blocks[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    blocks[:, 4:] = rng.integers(0, 256, (len(blocks), 140), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, *, arch: str = "llama", quant: str = "Q8_0", hidden: int = 256,
               layers: int = 2, seed: int = 0, rope_freqs: np.ndarray | None = None,
               vocab: str = "gpt2", vision: bool = False, pre: str | None = None) -> Path:
    """A tiny model: ``quant`` is Q8_0, Q4_0 or Q4_K for its matrices (norms stay F32,
    random around 1 as a trained model's are). ``arch`` llama, qwen3, gemma3 (its four norms
    per block, query and key norms, sliding window of 8, every second layer global: the file
    says so) or phi3 (fused ``attn_qkv`` and ``ffn_up``, its own output matrix);
    ``rope_freqs``: Llama 3.x's per-frequency RoPE factors, as llama.cpp stores them.
    ``vocab``: ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece: byte fallback tokens,
    scores, no merges, as Gemma's and Phi-3's files have it). ``vision``: a vision tower's
    and projector's tensors beside the text model, as Ollama's Gemma 3 file has them.
    ``pre``: ``tokenizer.ggml.pre`` (how text is split before the merges), with two digit
    merges that tell the splits apart ("3 4" before "1 2")."""
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
        if quant == "Q4_K":
            w.add_tensor(name, q4_k_blocks(rows, cols, rng), raw_dtype=T.Q4_K)
            return
        x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        kind = T[quant]
        w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

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
