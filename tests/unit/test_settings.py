"""Settings: precedence, validation and documentation."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance import settings as S
from appliance.cli import build_parser


def parse(*flags: str) -> object:
    return build_parser().parse_args(["serve", *flags])


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text("[engine]\nmax_batch_size = 4\nctx_size = 100\n[server]\nport = 9000\n")
    s = S.load(parse("--config", str(cfg), "--ctx-size", "300"),  # type: ignore[arg-type]
               env={"APPLIANCE_MAX_BATCH_SIZE": "6"})
    assert s.engine.max_batch_size == 6
    assert s.engine.ctx_size == 300
    assert s.server.port == 9000
    assert s.server.max_queue_depth == 32


def test_out_of_range_values_get_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        S.load(parse("--max-batch-size", "0"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be int"):
        S.load(None, env={"APPLIANCE_PORT": "eighty"})
    with pytest.raises(ValueError, match="must be one of"):
        S.load(None, env={"APPLIANCE_POLICY": "random"})


def test_unknown_config_keys_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text("[engine]\nmax_batch = 4\n")
    with pytest.raises(ValueError, match="unknown settings"):
        S.load(None, env={}, config_path=cfg)


def test_no_batch_means_one_sequence_at_a_time() -> None:
    assert S.load(parse("--no-batch"), env={}).engine.max_batch_size == 1  # type: ignore[arg-type]


def test_every_setting_is_documented_in_the_configuration_page() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for _, f in S.iter_fields():
        assert S.flag_name(f) in page, f"{S.flag_name(f)} missing from docs/configuration.md"
        assert S.env_name(f) in page, f"{S.env_name(f)} missing from docs/configuration.md"


def test_the_latency_objectives_reach_the_scheduler() -> None:
    from appliance.app import tick_objectives
    s = S.load(parse("--ttft-target-ms", "800", "--presence-s", "0",  # type: ignore[arg-type]
                     "--arrival-tokens", "128"), env={})
    o = tick_objectives(s)
    assert (o.ttft_target_s, o.presence_s, o.arrival_tokens) == (0.8, 0.0, 128)


def test_the_gather_window_reaches_the_engine_and_refuses_a_negative() -> None:
    from appliance.app import engine_config
    s = S.load(parse("--gather-ms", "35"), env={})  # type: ignore[arg-type]
    assert engine_config(s).gather_s == pytest.approx(0.035)
    assert engine_config(S.load(parse(), env={})).gather_s == pytest.approx(0.02)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gather_ms must be >= 0"):
        S.load(parse("--gather-ms", "-1"), env={})  # type: ignore[arg-type]


def test_bad_presence_settings_get_a_clear_error() -> None:
    with pytest.raises(ValueError, match="arrival_tokens must be >= 1"):
        S.load(parse("--arrival-tokens", "0"), env={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="presence_s must be >= 0"):
        S.load(parse("--presence-s", "-5"), env={})  # type: ignore[arg-type]


def test_the_data_folders_appliance_toml_is_read_when_no_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "appliance.toml").write_text('[jobs]\nurl_allow = "10.0.0.0/8"\n')
    env = {"APPLIANCE_DATA_DIR": str(tmp_path)}
    assert S.load(None, env=env).jobs.url_allow == "10.0.0.0/8"
    by_flag = S.load(parse("--data-dir", str(tmp_path)), env={})  # type: ignore[arg-type]
    assert by_flag.jobs.url_allow == "10.0.0.0/8"
    named = tmp_path / "other.toml"
    named.write_text("[jobs]\nurl_allow = \"\"\n")
    assert S.load(None, env={**env, "APPLIANCE_CONFIG": str(named)}).jobs.url_allow == ""
    assert S.load(None, env={"APPLIANCE_DATA_DIR": str(tmp_path / "none")}).jobs.url_allow \
        == ""
