"""The ipc kernels, compiled at run time for this GPU's architecture and cached.

NVRTC (through cuda.core's `Program`) turns `kernels.cu` into a cubin for `sm_<major><minor>`;
the cubin is kept under ~/.cache/anyccl (ANYCCL_CACHE_DIR overrides), named by a hash of the
source and the architecture, so later processes skip the compiler. Each process loads the module
once per device (cuModuleLoadData) and looks its kernels up by name.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from ... import gpu, settings

SOURCE = Path(__file__).with_name("kernels.cu")
_loaded: dict[int, dict[str, int]] = {}
_modules: list[Any] = []


def cache_dir() -> Path:
    root = settings.CACHE_DIR.get() or os.path.join(
        os.path.expanduser("~"), ".cache", "anyccl")
    return Path(root) / "kernels"


def _compile(source: str, arch: str) -> bytes:
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError:  # cuda.core before 1.0
        from cuda.core.experimental import Program, ProgramOptions
    program = Program(source, code_type="c++",
                      options=ProgramOptions(std="c++17", arch=arch))
    return bytes(program.compile("cubin").code)


def cubin(device: int) -> bytes:
    """The compiled kernels for `device`'s architecture: from the cache, else from NVRTC."""
    major, minor = gpu.compute_capability(device)
    arch = f"sm_{major}{minor}"
    source = SOURCE.read_text()
    digest = hashlib.sha256(f"{arch}\n{source}".encode()).hexdigest()[:20]
    path = cache_dir() / f"ipc-{arch}-{digest}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    code = _compile(source, arch)
    try:  # written whole under a temporary name, then renamed: readers never see half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(code)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: compile again next time
    return code


def kernels(device: int) -> dict[str, int]:
    """name -> CUfunction (its address) of every kernel, loaded into `device`'s primary context
    (made current by the caller)."""
    functions = _loaded.get(device)
    if functions is None:
        module = gpu.load_module(cubin(device))
        _modules.append(module)  # loaded for the life of the process
        names = ["all_gather", "broadcast", "barrier", "send", "recv", "ce_flags", "ce_wait"]
        kinds = ("all_reduce_0", "all_reduce_2", "reduce_scatter", "reduce_local")
        names += [f"{kind}_{dtype}_{op}" for kind in kinds
                  for dtype in ("float32", "float16", "bfloat16") for op in ("sum", "min", "max")]
        functions = _loaded[device] = {name: int(gpu.module_function(module, name))
                                       for name in names}
    return functions
