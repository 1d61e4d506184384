"""The compiled parts of the CPU backend (Linux only; see each file's header and
appliance/backend/). Everything else about the package is in pyproject.toml.

- appliance/backend/native/skinny_matmul.c: matrix products of few rows (decode steps),
  preloaded before OpenBLAS.
- appliance/backend/native/mlx_fast.cpp: vectorised softmax, SwiGLU gate, RoPE and RMSNorm as
  MLX operations. It is compiled against the MLX installed in the environment that builds
  it, so it is built only when MLX and nanobind can be imported there: install.sh and
  scripts/test.sh install the package, then build again with ``--no-build-isolation`` so it
  matches the MLX that runs it. The MLX version it was built for is written beside it
  (MLX_STAMP), so the backend can refuse it before loading it into another MLX.
- appliance/backend/native/quant_matmul.cpp: MLX's 4- and 8-bit quantized matrix product on
  the CPU, in the same extension; its loops are in quant_kernels.h, compiled for AVX2 in
  quant_avx2.cpp and for AVX-512 in quant_avx512.cpp, so they build side by side.

Both extensions are optional: where no compiler is found the package installs without them
and the engine runs MLX's own operations (the pure path). Neither is built with
-march=native: the baseline of the architecture, with the hot loops compiled once more for
AVX2 and AVX-512 and chosen when they load, so a build on one processor runs on another.
"""

import os
import sys
from pathlib import Path

from setuptools import Extension, setup

NATIVE = ["-O3", "-g0", "-Wno-psabi"]  # -g0: Python's own flags ask for debug info
HERE = Path(__file__).resolve().parent
BACKEND = "appliance/backend"
MLX_STAMP = HERE / BACKEND / "_mlx_fast.mlx-version"


def mlx_fast() -> Extension | None:
    try:
        import mlx
        import mlx.core as mx
        import nanobind
    except ImportError:
        print("setup.py: MLX or nanobind not importable here; appliance.backend._mlx_fast "
              "not built", file=sys.stderr)
        return None
    MLX_STAMP.write_text(mx.__version__ + "\n")
    nb = os.path.dirname(nanobind.__file__)
    mlx_dir = mlx.__path__[0]
    return Extension(
        "appliance.backend._mlx_fast",
        # the longest first: the compiling pool takes them in this order, two at a time on
        # two cores, and the build waits for the last to finish
        [f"{BACKEND}/native/{name}" for name in (
            "quant_avx512.cpp", "quant_matmul.cpp", "quant_avx2.cpp", "nanobind_runtime.cpp",
            "mlx_fast.cpp", "decode_layer.cpp")],
        # without it an edit of the header alone leaves the extension "up to date"
        depends=[f"{BACKEND}/native/{name}" for name in (
            "quant_kernels.h", "fast_kernels.h", "lane_sums.h", "staging.h",
            "attention_heads.inc")],
        include_dirs=[os.path.join(nb, "include"), os.path.join(nb, "ext", "robin_map", "include"),
                      os.path.join(nb, "src"), os.path.join(mlx_dir, "include")],
        library_dirs=[os.path.join(mlx_dir, "lib")], libraries=["mlx"],
        define_macros=[("NB_DOMAIN", "mlx"), ("NDEBUG", "1")],
        extra_compile_args=["-std=c++20", "-fvisibility=hidden", *NATIVE], language="c++",
        optional=True)


def _compile_in_parallel() -> None:
    """Compile an extension's sources side by side (setuptools compiles them one after the
    other): the three of _mlx_fast took 75 s in a row on a 2-core machine, and every
    install, CI's included, waits for them."""
    import distutils.ccompiler  # setuptools' copy (imported above), which build_ext uses
    from concurrent.futures import ThreadPoolExecutor

    from setuptools._distutils import ccompiler

    def compile_all(self, sources, output_dir=None, macros=None, include_dirs=None,  # type: ignore[no-untyped-def]
                    debug=False, extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj: str) -> None:
            src, ext = build[obj]
            self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
            list(pool.map(one, [o for o in objects if o in build]))
        return objects

    # two module trees can hold the class (setuptools._distutils and the distutils alias)
    for cls in {ccompiler.CCompiler, distutils.ccompiler.CCompiler}:
        cls.compile = compile_all  # type: ignore[method-assign]


ext_modules = []
# install.sh and scripts/test.sh install the package with this set, then build the
# extensions once against the installed MLX (scripts/build-native.sh), not twice.
if sys.platform == "linux" and os.environ.get("APPLIANCE_DEFER_NATIVE") != "1":
    _compile_in_parallel()
    ext_modules.append(Extension("appliance.backend._skinny_matmul",
                                 [f"{BACKEND}/native/skinny_matmul.c"],
                                 depends=[f"{BACKEND}/native/lane_sums.h"],
                                 libraries=["dl", "pthread"], extra_compile_args=NATIVE,
                                 optional=True))
    if (ext := mlx_fast()) is not None:
        ext_modules.append(ext)

setup(ext_modules=ext_modules)
