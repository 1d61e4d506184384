"""install.sh's roles on two machines: rank 0 (`APPLIANCE_DISTRIBUTED=HOSTFILE`) keeps the
daemon and sets the hostfile in its appliance.toml; another machine (`APPLIANCE_JOIN=HOSTFILE
APPLIANCE_RANK=1`) gets the model and the appliance-join service instead of the daemon, and
no database.

Nothing is installed and nothing starts: the virtual environment is a fake whose `python` is
the test's own (refusing pip) and whose `appliance` records its arguments, already stamped
as installed; `id` says an unprivileged user (so the systemd *user* unit is written, under a
temporary HOME) and `systemctl` records what it was asked. The units themselves are checked
by systemd-analyze in test_service_files.py; the heavy path (a real install that serves) is
test_install.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Machine:
    env: dict[str, str]
    home: Path
    data: Path
    venv: Path
    calls: Path  # what the fake appliance was asked, one line per call
    systemctl: Path  # what the fake systemctl was asked

    def install(self, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(ROOT / "install.sh")], cwd=cwd, env={**self.env, **env},
                              capture_output=True, text=True, timeout=120)

    def appliance_calls(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def systemctl_calls(self) -> list[str]:
        return self.systemctl.read_text().splitlines() if self.systemctl.exists() else []


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _install_stamp() -> str:
    """What install.sh writes once the package is installed for the cpu backend."""
    return subprocess.run(
        ["bash", "-c", "(echo cpu; cat pyproject.toml setup.py CMakeLists.txt appliance/backend/native/*) "
         "| sha256sum | cut -c1-16"], cwd=ROOT, capture_output=True, text=True,
        check=True).stdout.strip()


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    venv, fakes, home = tmp_path / "venv", tmp_path / "fakes", tmp_path / "home"
    for folder in (venv / "bin", fakes, home):
        folder.mkdir(parents=True)
    calls, systemctl = tmp_path / "appliance.calls", tmp_path / "systemctl.calls"
    _script(venv / "bin" / "python",
            "#!/bin/sh\ncase \"$*\" in *pip*) echo 'fake venv: install.sh tried to pip "
            "install (did its stamp change?)' >&2; exit 3 ;; esac\n"
            f"exec {sys.executable} \"$@\"\n")
    _script(venv / "bin" / "appliance", f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    (venv / ".appliance-install-stamp").write_text(_install_stamp() + "\n")
    _script(fakes / "systemctl", f"#!/bin/sh\necho \"$*\" >> {systemctl}\n")
    real_id = shutil.which("id")
    _script(fakes / "id", "#!/bin/sh\ncase \"$1\" in -u) echo 1000 ;; -un) echo bob ;; "
            f"*) exec {real_id} \"$@\" ;; esac\n")
    data = tmp_path / "data"
    env = {"PATH": f"{fakes}:{os.environ['PATH']}", "HOME": str(home),
           "APPLIANCE_VENV": str(venv), "APPLIANCE_DATA_DIR": str(data),
           "APPLIANCE_BACKEND": "cpu", "APPLIANCE_MODEL": "demo", "LANG": "C.UTF-8"}
    return Machine(env, home, data, venv, calls, systemctl)


RING = [["192.168.1.10:40000"], ["192.168.1.11:40000"]]


def test_a_second_machine_gets_the_join_service_and_no_database(
        machine: Machine, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(RING))
    units = machine.home / ".config" / "systemd" / "user"
    units.mkdir(parents=True)
    (units / "appliance.service").write_text("[Service]\n")  # it served alone before
    out = machine.install(APPLIANCE_JOIN=str(hostfile), APPLIANCE_RANK="1",
                          APPLIANCE_START="service")
    assert out.returncode == 0, out.stdout + out.stderr
    copied = machine.data / "hostfile.json"
    assert json.loads(copied.read_text()) == RING
    # a follower has no database and no admin: rank 0 owns them
    assert not [c for c in machine.appliance_calls() if c.startswith(("migrate", "user"))]
    unit = (units / "appliance-join.service").read_text()
    assert "@" not in unit and "User=" not in unit  # a user unit runs as its owner
    assert f"ExecStart={machine.venv}/bin/appliance join {copied} --rank 1" in unit
    assert f"Environment=APPLIANCE_DATA_DIR={machine.data}" in unit
    assert "Restart=always" in unit
    # one role per machine: the daemon's unit is stopped, the follower's started
    assert machine.systemctl_calls() == [
        "--user disable --now appliance", "--user daemon-reload",
        "--user enable appliance-join", "--user restart appliance-join"]
    assert "rank 1 waits for rank 0" in out.stdout


def test_a_second_machine_joins_in_the_foreground_without_a_service_manager(
        machine: Machine, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(RING))
    out = machine.install(APPLIANCE_JOIN=str(hostfile), APPLIANCE_START="foreground")
    assert out.returncode == 0, out.stdout + out.stderr
    assert machine.appliance_calls() == [f"join {machine.data}/hostfile.json --rank 1"]


def test_a_relative_hostfile_path_is_the_callers(machine: Machine, tmp_path: Path) -> None:
    (tmp_path / "hosts.json").write_text(json.dumps(RING))
    out = machine.install(cwd=tmp_path, APPLIANCE_JOIN="hosts.json", APPLIANCE_START="none")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((machine.data / "hostfile.json").read_text()) == RING
    assert f"start it with: {machine.venv}/bin/appliance join {machine.data}/hostfile.json " \
        "--rank 1" in out.stdout


def test_one_machine_alone_still_migrates_and_serves(machine: Machine) -> None:
    out = machine.install(APPLIANCE_START="foreground")
    assert out.returncode == 0, out.stdout + out.stderr
    assert machine.appliance_calls() == [
        "migrate", "user add admin --role admin --if-no-admin", "serve"]
    assert not (machine.data / "hostfile.json").exists()
    assert not (machine.data / "appliance.toml").exists()


def test_rank_0_keeps_its_config_and_gains_the_hostfile_setting(
        machine: Machine, tmp_path: Path) -> None:
    # mlx.distributed_config's hostfile: addresses without ports
    launcher = {"backend": "ring", "envs": [], "hosts": [
        {"ssh": "mini-1", "ips": ["10.0.0.1"], "rdma": []},
        {"ssh": "mini-2", "ips": ["10.0.0.2"], "rdma": []}]}
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(launcher))
    machine.data.mkdir()
    config = machine.data / "appliance.toml"
    config.write_text('[server]\nhost = "0.0.0.0"\n\n[distributed]  # two minis\n'
                      "control_port = 40481\n\n[engine]\nmax_batch_size = 4\n")
    for _ in range(2):  # idempotent: the second run changes nothing
        out = machine.install(APPLIANCE_DISTRIBUTED=str(hostfile), APPLIANCE_START="none")
        assert out.returncode == 0, out.stdout + out.stderr
        settings = tomllib.loads(config.read_text())
        assert settings == {"server": {"host": "0.0.0.0"}, "engine": {"max_batch_size": 4},
                            "distributed": {"control_port": 40481,
                                            "hostfile": str(machine.data / "hostfile.json")}}
    assert json.loads((machine.data / "hostfile.json").read_text()) == [
        ["10.0.0.1:40000"], ["10.0.0.2:40001"]]
    assert "migrate" in machine.appliance_calls()  # rank 0 keeps the database
    assert f"start it with: {machine.venv}/bin/appliance serve" in out.stdout


def test_rank_0_without_a_config_file_gets_one(machine: Machine, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(RING))
    out = machine.install(APPLIANCE_DISTRIBUTED=str(hostfile), APPLIANCE_START="none")
    assert out.returncode == 0, out.stdout + out.stderr
    assert tomllib.loads((machine.data / "appliance.toml").read_text()) == {
        "distributed": {"hostfile": str(machine.data / "hostfile.json")}}


@pytest.mark.parametrize(("env", "says"), [
    ({"APPLIANCE_JOIN": "{h}", "APPLIANCE_RANK": "2"}, "rank 2 is not in it (ranks 0-1)"),
    ({"APPLIANCE_JOIN": "{h}", "APPLIANCE_RANK": "0"}, "install it with APPLIANCE_DISTRIBUTED"),
    ({"APPLIANCE_JOIN": "{h}", "APPLIANCE_RANK": "one"}, "APPLIANCE_RANK must be a number"),
    ({"APPLIANCE_JOIN": "{h}", "APPLIANCE_DISTRIBUTED": "{h}"}, "not both"),
    ({"APPLIANCE_JOIN": "{h}.missing"}, "cannot read the hostfile"),
])
def test_install_sh_refuses_a_group_it_cannot_set_up(
        machine: Machine, tmp_path: Path, env: dict[str, str], says: str) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(RING))
    out = machine.install(APPLIANCE_START="service",
                          **{k: v.format(h=hostfile) for k, v in env.items()})
    assert out.returncode != 0 and says in out.stderr, out.stdout + out.stderr
    assert machine.systemctl_calls() == [] and not (machine.data / "hostfile.json").exists()


def test_install_sh_refuses_a_hostfile_of_one_rank(machine: Machine, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["192.168.1.10:40000"]]))
    out = machine.install(APPLIANCE_DISTRIBUTED=str(hostfile), APPLIANCE_START="none")
    assert out.returncode != 0 and "at least two ranks" in out.stderr
    assert not (machine.data / "appliance.toml").exists()


def test_install_sh_passes_shellcheck() -> None:
    tool = shutil.which("shellcheck")
    if tool is None:
        pytest.skip("NOT CHECKED: shellcheck is not installed (apt-get install shellcheck)")
    out = subprocess.run([tool, "install.sh"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout
