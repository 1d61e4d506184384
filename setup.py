"""The compiled parts of the CPU backend (Linux); everything else about the package is in
pyproject.toml. CMakeLists.txt says what is compiled and how; this file only hands the two
extensions to CMake and Ninja (docs/decisions/native-build.md):

- appliance/backend/native/skinny_matmul.c: matrix products of few rows (decode steps),
  preloaded before OpenBLAS.
- appliance/backend/native/mlx_fast.cpp, quant_matmul.cpp, decode_layer.cpp: the fast
  operations, the quantized matrix product and the fused decode layer, one MLX extension
  compiled against the MLX that pyproject.toml's build requirements pin (the same version
  the package depends on at run time).

A build that cannot make them stops with a message naming what is missing;
``APPLIANCE_BUILD_NATIVE=off`` builds the package without them (the daemon then says it is
degraded: appliance/backend/degraded.py). Off Linux nothing is compiled.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
OFF_SWITCH = "APPLIANCE_BUILD_NATIVE=off"
STAMP = "_mlx_fast.mlx-version"  # the MLX version _mlx_fast was built against (fast_ops.py)
# build requirement -> how to tell it is there (pyproject.toml's [build-system] names them)
REQUIRED_MODULES = {"mlx[cpu]": "mlx.core", "nanobind": "nanobind"}
REQUIRED_TOOLS = {"cmake": "cmake", "ninja": "ninja", "a C++ compiler (g++)": "g++"}


def missing_requirements() -> list[str]:
    """The build requirements this interpreter's environment lacks, by their names."""
    missing = [name for name, module in REQUIRED_MODULES.items()
               if importlib.util.find_spec(module.split(".")[0]) is None]
    tools = {name: tool for name, tool in REQUIRED_TOOLS.items()
             if not (name == "a C++ compiler (g++)" and os.environ.get("CXX"))}
    return missing + [name for name, tool in tools.items() if shutil.which(tool) is None]


class CMakeBuild(build_ext):
    """Configure and build every native target once with CMake and Ninja (in parallel), then
    put each where setuptools wants the extension (in the source tree for an editable
    install, the wheel's tree otherwise), with MLX's version stamp beside _mlx_fast."""

    def run(self) -> None:
        if not self.extensions:  # APPLIANCE_BUILD_NATIVE=off, or not Linux
            return
        if missing := missing_requirements():
            raise SystemExit(
                f"appliance: cannot build the native CPU code: missing {', '.join(missing)}. "
                "pip installs pyproject.toml's build requirements itself (do not pass "
                f"--no-build-isolation without them); or set {OFF_SWITCH} to build without "
                "the native code (the daemon runs, slowly, and says so).")
        build = Path(self.build_temp).resolve() / "cmake"
        # configured afresh each time: a cache from an earlier isolated build names tools in
        # its deleted environment (objects stay: Ninja rebuilds only what changed)
        (build / "CMakeCache.txt").unlink(missing_ok=True)
        jobs = str(max(1, len(os.sched_getaffinity(0))))
        subprocess.run(["cmake", "-S", str(HERE), "-B", str(build), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                       check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", jobs], check=True)
        self._cmake_dir = build
        super().run()

    def build_extension(self, ext: Extension) -> None:
        name = ext.name.rsplit(".", 1)[-1]
        target = Path(self.get_ext_fullpath(ext.name))
        built = next(self._cmake_dir.glob(f"{name}.*.so"))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)
        if name == "_mlx_fast":
            shutil.copyfile(self._cmake_dir / STAMP, target.with_name(STAMP))

    def copy_extensions_to_source(self) -> None:
        """An editable install copies the extensions into the source tree; the stamp too."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if ext.name.endswith("._mlx_fast"):
                package = ext.name.rsplit(".", 1)[0]
                built = Path(self.build_lib, *package.split("."), STAMP)
                shutil.copyfile(built, Path(build_py.get_package_dir(package), STAMP))


def ext_modules() -> list[Extension]:
    wanted = os.environ.get("APPLIANCE_BUILD_NATIVE", "on").lower()
    if wanted not in ("on", "off"):
        raise SystemExit(f"APPLIANCE_BUILD_NATIVE must be on or off, not {wanted!r}")
    if sys.platform != "linux" or wanted == "off":
        return []
    return [Extension(f"appliance.backend.{name}", sources=[])
            for name in ("_skinny_matmul", "_mlx_fast")]


setup(ext_modules=ext_modules(), cmdclass={"build_ext": CMakeBuild})
