"""What a daemon on the CPU runs without that would make it fast here, each reason with the
one command that fixes it (issue 53): said as a WARNING when the model loads, in ``/health``
(``backend.degraded``) and on the dashboard.

Two things are missing on a machine, never chosen by a setting (``native`` off or ``blas``
set to ``bundled`` is not degraded):

- the native code (``appliance.backend._mlx_fast``): a package built with
  ``APPLIANCE_BUILD_NATIVE=off``, or one built for another MLX than the one installed;
- a real BLAS: without Debian's OpenBLAS, MLX's CPU runs on the reference BLAS its wheel
  bundles (a 1,300-token prompt of a Llama-3.2-1B-shaped 4-bit model read in 43 s, against
  14.8 s on OpenBLAS).
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import sys
from urllib.parse import unquote, urlparse

OPENBLAS_FIX = "sudo apt-get install libopenblas0-pthread"


def reasons(*, kind: str, native_wanted: bool, native_missing: str | None,
            built_for: str | None, mlx_version: str, blas_mapped: bool | None,
            blas_installed: bool, python: str = sys.executable) -> list[str]:
    """Why this process is slower than it could be here (empty: it is not). ``native_wanted``:
    the settings ask for the native code; ``native_missing``: why it cannot run (None: it
    runs); ``built_for``: the MLX version the extension was built against, if one is there;
    ``blas_mapped``: OpenBLAS is mapped into the process (None: unknown, not Linux)."""
    if kind != "cpu":
        return []
    out = []
    if native_wanted and native_missing is not None:
        if built_for is not None and built_for != mlx_version:
            fix = f"{python} -m pip install 'mlx[cpu]=={built_for}'"
        else:
            fix = reinstall_command(python)
        out.append(f"the native CPU code is not in use ({native_missing}): prompts read "
                   f"1.7-2.3x slower and 4-bit models lose their kernel; fix: {fix}")
    if blas_mapped is False and not blas_installed:
        out.append("MLX runs on the reference BLAS bundled with mlx[cpu] (OpenBLAS is not "
                   f"installed): prompts read about 3x slower; fix: {OPENBLAS_FIX}")
    return out


def reinstall_command(python: str = sys.executable) -> str:
    """The pip command that builds the appliance again, native code included, from where
    this install came from (PEP 610's direct_url.json): its source folder, editable or not;
    else the package index (a wheel file built without the native code would not help)."""
    target, editable = "appliance", False
    try:
        direct = importlib.metadata.distribution("appliance").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        direct = None
    if direct:
        info = json.loads(direct)
        url = urlparse(info.get("url", ""))
        editable = bool(info.get("dir_info", {}).get("editable"))
        if url.scheme == "file" and not url.path.endswith(".whl"):
            target = unquote(url.path)
    args = [python, "-m", "pip", "install", "--force-reinstall", "--no-deps"]
    if target == "appliance":
        args += ["--no-binary", "appliance"]
    args += ["-e", target] if editable else [target]
    return shlex.join(args)
