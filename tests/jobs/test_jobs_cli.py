"""``appliance job add`` checks a job against the same allow list the daemon enforces: its
own settings tree (the data folder's ``appliance.toml``, the environment, flags before or
after the subcommand) and the list the running daemon started with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon import cli, make_household, start_daemon

LAN = "http://192.168.1.10:8123/api/logbook"


def _add(data_dir: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_URL_ALLOW"}
    env["APPLIANCE_DATA_DIR"] = str(data_dir)
    return subprocess.run([sys.executable, "-m", "appliance", "job", "add", name, "--user",
                           "alice", "--url", LAN, *extra], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def household(tmp_path: Path) -> Path:
    make_household(tmp_path)
    return tmp_path


def test_a_lan_address_is_refused_when_nothing_allows_it(household: Path) -> None:
    refused = _add(household, "digest")
    assert refused.returncode == 1 and "allow-list" in refused.stderr


def test_the_data_folders_config_file_and_flags_after_the_subcommand_allow_it(
        household: Path) -> None:
    assert _add(household, "by flag", "--url-allow", "192.168.1.10:8123").returncode == 0
    (household / "appliance.toml").write_text('[jobs]\nurl_allow = "192.168.1.0/24"\n')
    added = _add(household, "by file")
    assert added.returncode == 0, added.stderr


def test_the_running_daemons_own_flag_allows_it(household: Path, tiny_model: Path) -> None:
    d = start_daemon(tiny_model, household, "--url-allow", "192.168.1.10:8123")
    try:
        added = _add(household, "digest")
        assert added.returncode == 0, added.stderr
        assert "the daemon last started with url_allow='192.168.1.10:8123'" in added.stderr
        assert "digest" in cli(household, "job", "list")
    finally:
        assert d.terminate() == 0
