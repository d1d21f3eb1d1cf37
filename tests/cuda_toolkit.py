"""Find a CUDA toolkit's libNVVM and libdevice for numba, the way the PTX test and the device check need it.

numba finds libNVVM under ``$CUDA_HOME/nvvm/lib64`` or through the system loader;
toolkits laid out otherwise (a pip-style ``<root>/lib/libnvvm.so``, a distribution's
``/usr/lib``, the ``nvidia-cuda-nvcc-cu12`` wheel's ``site-packages/nvidia/cuda_nvcc``)
are found here by probing the usual roots, and handed to a child process as
``CUDA_HOME`` (for libdevice) plus ``LD_LIBRARY_PATH`` (for libNVVM).

``python tests/cuda_toolkit.py --export`` prints the ``export`` lines a shell
evaluates (nothing when no toolkit is found), and what was found on stderr.
"""
from __future__ import annotations

import ctypes.util
import glob
import os
import shlex
import shutil
import site
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

__all__ = ["toolkit_roots", "find_toolkit"]


def toolkit_roots() -> List[Path]:
    """Candidate toolkit roots, most specific first."""
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda", "/usr"]
    for packages in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        for sub in ("nvidia/cuda_nvcc", "nvidia/cu13", "nvidia/cu12"):
            roots.append(os.path.join(packages, sub))
    return [Path(r) for r in dict.fromkeys(filter(None, roots))]


def find_toolkit() -> Optional[Tuple[Dict[str, str], str]]:
    """(extra child environment, description) for a toolkit with libNVVM and libdevice, or None."""
    for root in toolkit_roots():
        libdevice = root / "nvvm" / "libdevice" / "libdevice.10.bc"
        if not libdevice.is_file():
            continue
        for libdir in (root / "nvvm" / "lib64", root / "nvvm" / "lib", root / "lib64", root / "lib"):
            if any(libdir.glob("libnvvm.so*")):
                env = {"CUDA_HOME": str(root)}
                if libdir != root / "nvvm" / "lib64":
                    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libdir), os.environ.get("LD_LIBRARY_PATH")]))
                return env, f"libnvvm in {libdir}, libdevice in {libdevice.parent}"
    if ctypes.util.find_library("nvvm"):  # on the loader path but no toolkit root found: let numba search
        return {}, f"libnvvm via the system loader ({ctypes.util.find_library('nvvm')})"
    return None


if __name__ == "__main__":
    found = find_toolkit()
    if found is None:
        print("cuda_toolkit: no libNVVM found (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda*, "
              "pip's nvidia/cuda_nvcc, the loader path)", file=sys.stderr)
        sys.exit(1)
    env, where = found
    print(f"cuda_toolkit: {where}", file=sys.stderr)
    if "--export" in sys.argv[1:]:
        for key, value in env.items():
            print(f"export {key}={shlex.quote(value)}")
