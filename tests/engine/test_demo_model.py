"""Tests for the shipped demo model and the demo_model builder."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import generate, load

from appliance.demo import build as demo_model
from appliance.demo.build import DEMO_MODEL_DIR, build_model, model_config, train_tokenizer
from appliance.demo.corpus import CORPUS_PATH, load_corpus, make_corpus
from appliance.demo.template import CHAT_TEMPLATE

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "README.md",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is a generator?"},
]


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    loaded: tuple[Any, Any] = load(str(DEMO_MODEL_DIR))  # type: ignore[assignment]
    return loaded


def test_shipped_demo_model_files_and_size() -> None:
    names = {p.name for p in DEMO_MODEL_DIR.iterdir()}
    assert names >= EXPECTED_FILES
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir())
    assert total < 10 * 1024 * 1024
    assert "demo model" in (DEMO_MODEL_DIR / "README.md").read_text()


def test_shipped_demo_config_is_labelled_demo() -> None:
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["appliance_demo"] is True
    assert config["model_type"] == "llama"
    assert config == model_config("demo")


def test_shipped_demo_chat_template(demo: tuple[Any, Any]) -> None:
    _, tok = demo
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is a generator?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids[0] == 1 and ids.count(2) == 2
    assert tok.eos_token == "<|im_end|>"
    assert 2 in tok.eos_token_ids
    no_prompt = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


def test_shipped_demo_generates_text(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    prompt = tok.apply_chat_template(MESSAGES[1:], add_generation_prompt=True)
    text = generate(model, tok, prompt, max_tokens=40)
    assert text.strip()
    assert sum(ch.isalpha() for ch in text) > len(text) / 2


def test_build_tiny_loads(tmp_path: Path) -> None:
    out = build_model(tmp_path / "tiny", shape="tiny", seed=1)
    assert {p.name for p in out.iterdir()} >= EXPECTED_FILES
    loaded: tuple[Any, Any] = load(str(out))  # type: ignore[assignment]
    model, tok = loaded
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    assert config["appliance_demo"] is True
    logits = model(mx.array([[1, 5, 9]]))
    assert logits.shape == (1, 3, config["vocab_size"])
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert isinstance(generate(model, tok, prompt, max_tokens=5), str)


def test_build_tiny_is_reproducible(tmp_path: Path) -> None:
    a = build_model(tmp_path / "a", shape="tiny", seed=3)
    b = build_model(tmp_path / "b", shape="tiny", seed=3)
    for name in EXPECTED_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_smollm_135m_config() -> None:
    config = model_config("smollm-135m")
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
    }
    assert {k: config[k] for k in expected} == expected


def test_smollm_135m_tokenizer_has_exactly_49152_decodable_ids() -> None:
    tok = train_tokenizer(load_corpus(), 49152)
    assert tok.get_vocab_size() == 49152
    for i in range(49152):
        tok.decode([i], skip_special_tokens=False)
    assert tok.token_to_id("<|im_end|>") == 2


def test_unknown_shape_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_model(tmp_path, shape="huge")


def test_corpus_header_and_template_constants() -> None:
    header = CORPUS_PATH.read_text(encoding="utf-8")[:4000]
    assert "Python Software Foundation" in header
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in header
    assert len(load_corpus()) > 1000
    assert "add_generation_prompt" in CHAT_TEMPLATE


@pytest.mark.skipif(
    platform.python_implementation() != "CPython" or platform.python_version() != "3.11.7",
    reason="the committed corpus was generated from CPython 3.11.7's standard library",
)
def test_make_corpus_reproduces_committed_file() -> None:
    assert make_corpus() == CORPUS_PATH.read_text(encoding="utf-8")


def test_main_builds_tiny(tmp_path: Path) -> None:
    assert demo_model.main(["--out", str(tmp_path / "m"), "--shape", "tiny"]) == 0
    assert (tmp_path / "m" / "model.safetensors").exists()
