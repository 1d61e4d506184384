"""``appliance key create ha --default-class voice``: Home Assistant's key from the CLI."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.daemon import PASSWORD, cli


def test_a_key_made_with_a_default_class_lists_it(tmp_path: Path) -> None:
    cli(tmp_path, "user", "add", "ha", "--max-class", "voice", "--password-stdin",
        stdin=PASSWORD + "\n")
    cli(tmp_path, "user", "add", "bob", "--password-stdin", stdin=PASSWORD + "\n")
    out = cli(tmp_path, "key", "create", "ha", "--name", "ha", "--default-class", "voice")
    assert "default voice" in out
    listed = cli(tmp_path, "key", "list", "--user", "ha")
    assert any("\tha\t" in row and "default=voice" in row for row in listed.splitlines())
    with pytest.raises(subprocess.CalledProcessError) as err:
        cli(tmp_path, "key", "create", "bob", "--default-class", "voice")
    assert "above the key's maximum" in err.value.stderr
