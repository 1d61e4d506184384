"""MLX's CUDA kernel cache kept in the data directory (appliance/backend/gpu.py); the
warm-up's products are in tests/engine/test_gpu_warm.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from appliance.backend import gpu


def test_the_cache_is_kept_only_on_cuda_in_a_folder_per_version_and_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu.CACHE_ENV, raising=False)
    monkeypatch.setattr(gpu, "gpu_name", lambda: "NVIDIA H200 9.0")
    assert gpu.keep_kernel_cache("cpu", tmp_path) is None
    assert gpu.keep_kernel_cache("metal", tmp_path) is None
    assert gpu.CACHE_ENV not in gpu.os.environ
    path = gpu.keep_kernel_cache("cuda", tmp_path)
    assert path is not None and path.is_dir()
    assert path.parent == tmp_path / "cache" / "mlx-ptx"
    assert path.name.endswith("-NVIDIA-H200-9.0") and "/" not in path.name
    assert gpu.os.environ[gpu.CACHE_ENV] == str(path)
    other = gpu.kernel_cache_dir(tmp_path, "0.32.4", "NVIDIA RTX 4090 8.9")
    assert other != gpu.kernel_cache_dir(tmp_path, "0.32.4", "NVIDIA H200 9.0")
    assert other != gpu.kernel_cache_dir(tmp_path, "0.33.0", "NVIDIA RTX 4090 8.9")


def test_a_cache_the_admin_chose_is_left_alone(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpu.CACHE_ENV, "/srv/ptx")
    assert gpu.keep_kernel_cache("cuda", tmp_path) is None
    assert gpu.os.environ[gpu.CACHE_ENV] == "/srv/ptx"
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_data_dir_warns_and_leaves_mlx_its_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(gpu.CACHE_ENV, raising=False)
    monkeypatch.setattr(gpu, "gpu_name", lambda: "gpu")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger=gpu.log.name):
        assert gpu.keep_kernel_cache("cuda", blocker) is None
    assert gpu.CACHE_ENV not in gpu.os.environ
    assert "compiles the kernels again" in caplog.text
