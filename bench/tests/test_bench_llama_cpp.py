"""llama.cpp's server as a peer of the serving benchmark: its command line, the checks
before anything starts, and its ratio rows."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from bench.peers import llama_cpp
from bench.serve import Config, build_parser, config_from_args, server_argv
from bench.serve_stats import LevelStats, compute_ratios, render_table


def level(c: int, tps: float) -> LevelStats:
    return LevelStats(concurrency=c, requests=c, errors=0, output_tokens=64 * c, wall_s=1.0,
                      tokens_per_s=tps, ttft_p50_s=0.2, ttft_p95_s=0.2, itl_p50_s=0.01,
                      itl_p95_s=0.02, tpot_mean_s=0.01, token_source="usage")


def config(tmp_path: Path, *extra: str) -> Config:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    args = build_parser().parse_args(["--servers", "llama_cpp", "--gguf", str(gguf),
                                      "--concurrency", "1,8", "--output-dir", str(tmp_path),
                                      *extra])
    return config_from_args(args, "python -m bench.serve", dt.datetime.now(dt.UTC))


def test_each_slot_holds_the_longest_prompt_and_answer() -> None:
    assert llama_cpp.slot_context(0, 64) == 1024
    assert llama_cpp.slot_context(2000, 256) == 4608  # 256 + 4000 + 256, rounded up to 256
    cmd = llama_cpp.argv(["llama-server"], Path("m.gguf"), "127.0.0.1", 9, 8, 2, 0, 64)
    assert cmd == ["llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "9",
                   "-np", "8", "-t", "2", "-c", "8192"]


def test_llama_server_gets_one_slot_per_client_of_the_highest_level(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--llama-cmd", "nice -n 0 /opt/llama-server", "--llama-threads", "4")
    assert cfg.model_dir is None  # no MLX model needed for llama_cpp alone
    argv = server_argv("llama_cpp", cfg, 1234)
    assert argv[:4] == ["nice", "-n", "0", "/opt/llama-server"]
    assert argv[argv.index("-np") + 1] == "8" and argv[argv.index("-t") + 1] == "4"
    assert argv[argv.index("-m") + 1] == str((tmp_path / "m.gguf").resolve())


def test_llama_cpp_without_a_gguf_is_refused_before_anything_starts() -> None:
    args = build_parser().parse_args(["--servers", "llama_cpp"])
    with pytest.raises(SystemExit, match="needs --gguf FILE"):
        config_from_args(args, "x", dt.datetime.now(dt.UTC))


def test_a_missing_binary_says_how_to_build_it(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(llama_cpp.BINARY_ENV, str(tmp_path / "no-such-llama-server"))
    with pytest.raises(SystemExit, match="build-llama-server.sh"):
        config(tmp_path)


def test_the_table_has_a_ratio_row_per_reference() -> None:
    results = {"ours": [level(1, 12.0)], "mlx_lm": [level(1, 6.0)], "llama_cpp": [level(1, 24.0)]}
    table = render_table(results, compute_ratios(results["ours"], results["mlx_lm"]),
                         {"llama_cpp": compute_ratios(results["ours"], results["llama_cpp"])})
    rows = table.splitlines()[2:]
    assert [row.split("|")[2].strip() for row in rows] == [
        "ours", "mlx_lm", "llama_cpp", "ours/mlx_lm", "ours/llama_cpp"]
    assert "**2.00×**" in rows[3] and "**0.50×**" in rows[4]
