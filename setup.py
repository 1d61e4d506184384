"""The one compiled part: appliance/native/skinny_matmul.c (Linux only; see its header).

Everything else about the package is in pyproject.toml. The extension is optional: where no
C compiler is found the package installs without it and `appliance serve` runs OpenBLAS's
gemm for every product (slower decode of small batches). It is compiled for this machine's
own processor (-march=native): build it where it runs.
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform == "linux":
    ext_modules.append(Extension("appliance._skinny_matmul", ["appliance/native/skinny_matmul.c"],
                                 libraries=["dl", "pthread"], extra_compile_args=["-O3", "-march=native"], optional=True))

setup(ext_modules=ext_modules)
