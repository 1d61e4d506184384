"""The reasons a daemon on the CPU calls itself degraded, each with its one fix
(appliance/backend/degraded.py); through a started daemon: tests/integration/
test_backend_degraded.py."""

from __future__ import annotations

from typing import Any

from appliance.backend.degraded import OPENBLAS_FIX, reasons, reinstall_command

FAST: dict[str, Any] = {"kind": "cpu", "native_wanted": True, "native_missing": None,
                        "built_for": "0.32.4", "mlx_version": "0.32.4", "blas_mapped": True,
                        "blas_installed": True, "python": "/venv/bin/python"}


def test_a_cpu_daemon_with_its_native_code_and_openblas_is_not_degraded() -> None:
    assert reasons(**FAST) == []


def test_a_package_built_without_the_native_code_names_the_reinstall() -> None:
    [reason] = reasons(**{**FAST, "built_for": None,
                          "native_missing": "appliance.backend._mlx_fast was not built"})
    assert "_mlx_fast was not built" in reason
    assert reason.endswith("; fix: " + reinstall_command("/venv/bin/python"))
    assert "--force-reinstall" in reason


def test_an_extension_built_for_another_mlx_names_the_mlx_it_needs() -> None:
    [reason] = reasons(**{**FAST, "mlx_version": "0.33.0",
                          "native_missing": "built for MLX 0.32.4, this is MLX 0.33.0"})
    assert reason.endswith("; fix: /venv/bin/python -m pip install 'mlx[cpu]==0.32.4'")


def test_no_openblas_on_the_machine_names_the_package_to_install() -> None:
    [reason] = reasons(**{**FAST, "blas_mapped": False, "blas_installed": False})
    assert "reference BLAS" in reason and reason.endswith("; fix: " + OPENBLAS_FIX)


def test_what_a_setting_turned_off_is_not_degraded() -> None:
    # APPLIANCE_NATIVE=off, and --blas bundled with OpenBLAS installed
    assert reasons(**{**FAST, "native_wanted": False, "native_missing": "off"}) == []
    assert reasons(**{**FAST, "blas_mapped": False}) == []


def test_metal_and_cuda_take_none_of_the_cpus_parts() -> None:
    for kind in ("metal", "cuda"):
        assert reasons(**{**FAST, "kind": kind, "native_missing": "GPU",
                          "blas_mapped": False, "blas_installed": False}) == []
