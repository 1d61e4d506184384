"""The compiled parts (Linux only; see each file's header). Everything else about the package
is in pyproject.toml.

- appliance/native/skinny_matmul.c: matrix products of few rows (decode steps), preloaded
  before OpenBLAS.
- appliance/native/mlx_fast.cpp: a vectorised softmax and SwiGLU gate as MLX operations. It
  is compiled against the MLX installed in the environment that builds it, so it is built
  only when MLX and nanobind can be imported there: install.sh and scripts/test.sh install
  the package, then build again with ``--no-build-isolation`` so it matches the MLX that
  runs it.

Both are optional: where no compiler is found the package installs without them and the
engine runs MLX's own operations (slower). Both are compiled for this machine's own
processor (-march=native): build them where they run.
"""

import os
import sys

from setuptools import Extension, setup

NATIVE = ["-O3", "-march=native"]


def mlx_fast() -> Extension | None:
    try:
        import mlx
        import nanobind
    except ImportError:
        print("setup.py: MLX or nanobind not importable here; appliance._mlx_fast not built",
              file=sys.stderr)
        return None
    nb = os.path.dirname(nanobind.__file__)
    mlx_dir = mlx.__path__[0]
    return Extension(
        "appliance._mlx_fast",
        ["appliance/native/mlx_fast.cpp", "appliance/native/nanobind_runtime.cpp"],
        include_dirs=[os.path.join(nb, "include"), os.path.join(nb, "ext", "robin_map", "include"),
                      os.path.join(nb, "src"), os.path.join(mlx_dir, "include")],
        library_dirs=[os.path.join(mlx_dir, "lib")], libraries=["mlx"],
        define_macros=[("NB_DOMAIN", "mlx"), ("NDEBUG", "1")],
        extra_compile_args=["-std=c++20", "-fvisibility=hidden", *NATIVE], language="c++",
        optional=True)


ext_modules = []
if sys.platform == "linux":
    ext_modules.append(Extension("appliance._skinny_matmul", ["appliance/native/skinny_matmul.c"],
                                 libraries=["dl", "pthread"], extra_compile_args=NATIVE,
                                 optional=True))
    if (ext := mlx_fast()) is not None:
        ext_modules.append(ext)

setup(ext_modules=ext_modules)
