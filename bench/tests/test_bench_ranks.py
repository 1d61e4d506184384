"""The serving benchmark on two ranks: the ring hostfile, pinning, each rank's command line
and environment, the group of rank processes, and the Qwen 2 twin of a Llama model. No test
here starts a server; the group's processes are short sleeps."""

from __future__ import annotations

import datetime as dt
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from bench import qwen2_model, ranks
from bench.process import ServerGroup, ServerProcess, running, server_group
from bench.serve import Config, build_parser, config_from_args, make_ranked_server
from bench.serve_stats import LevelStats, render_report


def test_the_hostfile_is_mlx_rings_one_address_list_per_rank(tmp_path: Path) -> None:
    path = ranks.write_hostfile(tmp_path / "hosts.json", [41000, 41001])
    assert json.loads(path.read_text()) == [["127.0.0.1:41000"], ["127.0.0.1:41001"]]
    with pytest.raises(ValueError, match="two distinct ports"):
        ranks.ring_hostfile([41000])
    with pytest.raises(ValueError, match="two distinct ports"):
        ranks.ring_hostfile([41000, 41000])


def test_each_rank_gets_a_core_of_its_own_until_cores_run_out() -> None:
    assert ranks.rank_cores(2, [3, 1]) == [1, 3]
    assert ranks.rank_cores(3, [0, 1]) == [0, 1, 0]
    assert ranks.pinned(["python", "-m", "x"], 1) == ["taskset", "-c", "1", "python", "-m", "x"]
    assert ranks.pinned(["python"], None) == ["python"]


def test_mlx_lm_runs_the_same_pipelined_line_on_every_rank_told_its_rank_by_env() -> None:
    argv = ranks.mlx_lm_argv(["mlx_lm", "server"], Path("/m"), "127.0.0.1", 8080, 8)
    assert argv[-1] == "--pipeline" and argv[argv.index("--decode-concurrency") + 1] == "8"
    env = ranks.mlx_rank_env({"PATH": "/bin"}, 1, Path("/h.json"))
    assert env == {"PATH": "/bin", "MLX_RANK": "1", "MLX_HOSTFILE": "/h.json"}


def test_our_leader_serves_and_our_follower_joins_the_same_hostfile() -> None:
    leader = ranks.our_leader_argv(["appliance", "serve"], Path("/m"), "127.0.0.1", 8080, 8,
                                   Path("/h.json"), 40999)
    assert leader[-4:] == ["--distributed", "/h.json", "--control-port", "40999"]
    follower = ranks.our_follower_argv(["appliance", "join"], Path("/m"), Path("/h.json"), 1,
                                       40999)
    assert follower == ["appliance", "join", "/h.json", "--rank", "1", "--model", "/m",
                        "--control-port", "40999"]
    with pytest.raises(ValueError):
        ranks.our_follower_argv(["appliance", "join"], Path("/m"), Path("/h.json"), 0, 1)


def test_only_architectures_mlx_lm_can_split_pipeline() -> None:
    assert ranks.pipelines("qwen2")
    assert not ranks.pipelines("llama")
    assert not ranks.pipelines("no_such_architecture")


def qwen2_dir(tmp_path: Path, *, index: bool) -> Path:
    """A model directory with a config and one small weight file (no real model)."""
    import mlx.core as mx

    model = tmp_path / "qwen2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    weights = {"model.norm.weight": mx.ones((4,))}
    mx.save_safetensors(str(model / qwen2_model.WEIGHTS), weights)
    if index:
        (model / qwen2_model.INDEX).write_text("{}")
    return model


def ranked_config(tmp_path: Path, model: Path, *extra: str) -> Config:
    args = build_parser().parse_args(["--ranks", "2", "--model", str(model), "--concurrency",
                                      "1,8", "--output-dir", str(tmp_path / "out"), *extra])
    return config_from_args(args, "python -m bench.serve --ranks 2", dt.datetime.now(dt.UTC))


def test_two_rank_servers_meet_on_a_fresh_hostfile_pinned_apart(tmp_path: Path) -> None:
    cfg = ranked_config(tmp_path, qwen2_dir(tmp_path, index=True),
                        "--our-cmd", "appliance serve", "--join-cmd", "appliance join")
    mlx = make_ranked_server("mlx_lm", cfg, 8080, tmp_path / "out" / "mlx_lm.log")
    assert [r.argv[:3] for r in mlx.ranks] == [["taskset", "-c", str(c)] for c in
                                               ranks.rank_cores(2, ranks.allowed_cores())]
    assert [r.env["MLX_RANK"] for r in mlx.ranks] == ["0", "1"]
    assert mlx.ranks[1].log_path.name == "mlx_lm-rank1.log"
    hostfile = Path(mlx.ranks[0].env["MLX_HOSTFILE"])
    assert len(json.loads(hostfile.read_text())) == 2

    ours = make_ranked_server("ours", cfg, 8081, tmp_path / "out" / "ours.log")
    leader, follower = (r.argv[3:] for r in ours.ranks)
    assert leader[:2] == ["appliance", "serve"] and "--distributed" in leader
    assert follower[:2] == ["appliance", "join"] and "--rank" in follower
    ports = {r.argv[r.argv.index("--control-port") + 1] for r in ours.ranks}
    assert len(ports) == 1 and "MLX_RANK" not in ours.ranks[1].env


def test_unpinned_ranks_run_as_they_are(tmp_path: Path) -> None:
    cfg = ranked_config(tmp_path, qwen2_dir(tmp_path, index=True), "--no-pin",
                        "--mlx-cmd", "mlx_lm server")
    group = make_ranked_server("mlx_lm", cfg, 8080, tmp_path / "out" / "mlx_lm.log")
    assert all(r.argv[:2] == ["mlx_lm", "server"] for r in group.ranks)


def test_a_model_mlx_lm_cannot_pipeline_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match="cannot pipeline a llama model"):
        ranked_config(tmp_path, model)
    ranked_config(tmp_path, model, "--servers", "ours")  # ours alone: its own business


def test_the_weight_index_sharded_load_reads_is_written_when_missing(tmp_path: Path) -> None:
    model = qwen2_dir(tmp_path, index=False)
    ranked_config(tmp_path, model)
    index = json.loads((model / qwen2_model.INDEX).read_text())
    assert index["weight_map"] == {"model.norm.weight": "model.safetensors"}
    assert index["metadata"]["total_size"] == 16


def test_llama_cpp_and_zero_ranks_are_refused(tmp_path: Path) -> None:
    for extra in (["--servers", "llama_cpp", "--ranks", "2"], ["--ranks", "0"]):
        with pytest.raises(SystemExit):
            config_from_args(build_parser().parse_args(extra), "x", dt.datetime.now(dt.UTC))


def sleeper(tmp_path: Path, seconds: float) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def test_a_group_has_exited_when_any_rank_has_and_stops_every_rank(tmp_path: Path) -> None:
    group = server_group("x", [sleeper(tmp_path, 30), sleeper(tmp_path, 0)],
                         [{}, {}], tmp_path / "x.log")
    group.follower_grace_s = 0.1
    with running(group):
        group.ranks[1].proc.wait(timeout=10)  # type: ignore[union-attr]
        assert group.exited() == 0 and group.ranks[0].exited() is None
    assert all(r.exited() is not None for r in group.ranks)
    assert group.rank_facts()[0]["exit_code"] == -15  # SIGTERM by its own PID
    assert "rank 1" in group.log_tail()


def test_a_group_starts_its_followers_first(tmp_path: Path) -> None:
    started: list[str] = []

    class Recorder(ServerProcess):
        def start(self) -> None:
            started.append(self.name)

    group = ServerGroup([Recorder("lead", [], {}, tmp_path / "a"),
                         Recorder("follow", [], {}, tmp_path / "b")])
    group.start()
    assert started == ["follow", "lead"]


def test_the_report_names_every_rank_command() -> None:
    stats = LevelStats(concurrency=1, requests=1, errors=0, output_tokens=8, wall_s=1.0,
                       tokens_per_s=8.0, ttft_p50_s=0.1, ttft_p95_s=0.1, itl_p50_s=0.01,
                       itl_p95_s=0.01, tpot_mean_s=0.01, token_source="usage")
    report = {
        "meta": {"date": "d", "command": "python -m bench.serve --ranks 2",
                 "model": {"path": "/m"}, "blas_report": "b", "git_commit": "c",
                 "versions": {"python": "3.11"}, "machine": "m", "requests_per_client": 1,
                 "max_tokens": 8, "max_batch_size": 1, "ranks": 2, "pinned": True},
        "servers": {"mlx_lm": {"levels": [asdict(stats)], "command": "taskset -c 0 a",
                               "log": "l", "ranks": [{"rank": 0, "command": "taskset -c 0 a"},
                                                     {"rank": 1, "command": "taskset -c 1 a"}]}},
        "ratios": [],
    }
    text = render_report(report)
    assert "2 ranks per server" in text and "pinned to a core of its own" in text
    assert "rank 1: `taskset -c 1 a`" in text


def test_the_qwen2_twin_of_a_llama_computes_the_same_logits(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.utils import load_model

    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "intermediate_size": 64, "vocab_size": 64, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False}
    mx.random.seed(0)
    source = tmp_path / "llama"
    source.mkdir()
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(source / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (source / "config.json").write_text(json.dumps(config))

    twin = qwen2_model.convert(source, tmp_path / "qwen2")
    loaded, twin_config = load_model(twin)
    assert twin_config["model_type"] == "qwen2" and (twin / qwen2_model.INDEX).exists()
    tokens = mx.array([[1, 5, 9, 3]])
    assert mx.allclose(loaded(tokens), model(tokens), atol=1e-5).item()

    quantized = qwen2_model.convert(source, tmp_path / "qwen2-q4", bits=4)
    q_model, q_config = load_model(quantized)
    assert q_config["quantization"] == {"group_size": 32, "bits": 4}
    assert q_model(tokens).shape == (1, 4, 64)


def test_a_llama_with_biases_has_no_exact_twin() -> None:
    with pytest.raises(ValueError, match="biases"):
        qwen2_model.qwen2_config({"model_type": "llama", "hidden_size": 8,
                                  "num_attention_heads": 2, "attention_bias": True})
    with pytest.raises(ValueError, match="expected a llama"):
        qwen2_model.qwen2_config({"model_type": "gemma3_text"})
