"""Which backend the installed MLX is, read without importing MLX, and the CPU's restart with
LD_PRELOAD taken only on the CPU (appliance/backend). No MLX, no subprocess."""

from __future__ import annotations

import importlib.metadata

import pytest

from appliance import backend
from appliance.backend import process


def test_macos_is_metal_and_linux_follows_the_installed_mlx_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend.installed_kind("darwin") == "metal"
    real = importlib.metadata.version

    def with_cuda(name: str) -> str:
        if name == "mlx-cuda-12":
            return "0.32.4"
        return real(name)

    def without_cuda(name: str) -> str:
        if name in backend.CUDA_DISTRIBUTIONS:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", with_cuda)
    assert backend.installed_kind("linux") == "cuda"
    monkeypatch.setattr(importlib.metadata, "version", without_cuda)
    assert backend.installed_kind("linux") == "cpu"


@pytest.mark.parametrize("kind", ["metal", "cuda"])
def test_no_restart_with_cpu_libraries_off_the_cpu(kind: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def execve(*args: object) -> None:
        raise AssertionError(f"restarted for {kind}")

    monkeypatch.delenv(process.REEXEC_MARK, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(process.os, "execve", execve)
    process.prepare(kind, "auto", True, ["serve"])  # returns: nothing preloaded


def test_the_cpu_restarts_once_with_its_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, str]] = []

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.append(env)

    monkeypatch.delenv(process.REEXEC_MARK, raising=False)
    monkeypatch.setattr(process, "preload_env", lambda blas, kernel: {"LD_PRELOAD": "x.so"})
    monkeypatch.setattr(process.os, "execve", execve)
    process.prepare("cpu", "auto", True, ["serve"])
    assert seen == [{"LD_PRELOAD": "x.so", process.REEXEC_MARK: "1"}]
    monkeypatch.setenv(process.REEXEC_MARK, "1")  # the restarted process does not again
    process.prepare("cpu", "auto", True, ["serve"])
    assert len(seen) == 1
