"""The tiled kernel's rate benchmark: the shapes it takes from a model, the bytes and rates it
reports, and its refusal of bad row counts."""

from __future__ import annotations

import mlx.nn as nn
import pytest

from bench.tiled_rate import main, model_shapes, rate, report, tiled_bytes


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.QuantizedEmbedding(256, 64, group_size=32, bits=8)
        self.up = nn.QuantizedLinear(64, 128, bias=False, group_size=32, bits=4)
        self.up2 = nn.QuantizedLinear(64, 128, bias=False, group_size=32, bits=4)
        self.down = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=8)


class Untied(Tied):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.QuantizedLinear(64, 256, bias=False, group_size=32, bits=4)


def test_shapes_are_distinct_and_the_tied_embedding_is_the_output_layer() -> None:
    assert model_shapes(Tied()) == [(64, 128, 8), (128, 64, 4), (256, 64, 8)]
    # an untied embedding is only looked up: its head is the product
    assert model_shapes(Untied()) == [(64, 128, 8), (128, 64, 4), (256, 64, 4)]


def test_bytes_and_rates() -> None:
    # 4-bit: half a byte a weight; a float16 scale and bias per 32
    assert tiled_bytes((16, 64, 4)) == 16 * 64 // 2 + 2 * 2 * 16 * 2
    r = rate((2048, 2048, 4), 0.5, 8)
    assert r["gb_per_s"] == pytest.approx(tiled_bytes((2048, 2048, 4)) / 0.5e-3 / 1e9)
    assert r["gmac_per_s"] == pytest.approx(8 * 2048 * 2048 / 0.5e-3 / 1e9)
    text = report("models/m", {(2048, 2048, 4): {1: 0.25, 8: 0.5}}, 30.0, 2, "a machine")
    assert "| 2048 x 2048, 4 | 0.25, 10.5, 17 | 0.50, 5.2, 67 |" in text
    assert "30.0 GB/s" in text and "threads: 2" in text


@pytest.mark.parametrize("rows", ["0,8", "x", ""])
def test_bad_row_counts_are_refused_before_any_model_loads(
        rows: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no/such/model", "--rows", rows])
    assert exc.value.code == 2
    assert "expected positive integers like 1,8,128" in capsys.readouterr().err
