"""The daemon does not start without its pages (issue 53 item 9): ``web`` ships in the same
wheel, so a failed import of it is a broken install to report, not a reason to serve the API
alone with no word."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BLOCK_WEB = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "web.routes":
            raise ImportError("web.routes is missing")
sys.meta_path.insert(0, Block())
import appliance.app
"""


def test_a_daemon_without_its_pages_does_not_start_quietly() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", BLOCK_WEB], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "web.routes is missing" in run.stderr
