"""The ipc kernels, compiled at run time for this GPU's architecture and cached.

NVRTC (through cuda.core's `Program`) turns the sources in `kernels/` -- the shared constants of
memory.py as #defines, then the primitives, then the kernels -- into one cubin for
`sm_<major><minor>`;
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
from .memory import KERNEL_DEFINES

KERNELS = Path(__file__).with_name("kernels")
SOURCES = [KERNELS / name for name in ("primitives.cuh", "all_reduce.cu", "movement.cu",
                                       "messages.cu", "copy_engine_flags.cu")]
# typed kernels: <kind>_<dtype>_<op>
KINDS = ("all_reduce_low_latency", "all_reduce_low_latency_two_shot", "all_reduce_one_shot",
         "all_reduce_two_shot", "reduce_scatter", "ce_step")


def source() -> str:
    """The whole source NVRTC compiles: the shared constants, then every file in order."""
    defines = "".join(f"#define {name} {value}\n" for name, value in KERNEL_DEFINES.items())
    return defines + "".join(f"\n// ---- {path.name}\n{path.read_text()}" for path in SOURCES)
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
    text = source()
    digest = hashlib.sha256(f"{arch}\n{text}".encode()).hexdigest()[:20]
    path = cache_dir() / f"ipc-{arch}-{digest}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    code = _compile(text, arch)
    try:  # written whole under a temporary name, then renamed: readers never see half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(code)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: compile again next time
    return code


def kernel_names() -> list[str]:
    """Every kernel the backend launches, by the name it has in the source."""
    names = ["all_gather", "broadcast", "barrier", "send", "recv", "ce_flags", "ce_wait",
             "ce_copy"]
    return names + [f"{kind}_{dtype}_{op}" for kind in KINDS
                    for dtype in ("float32", "float16", "bfloat16") for op in ("sum", "min", "max")]


def kernels(device: int) -> dict[str, int]:
    """name -> CUfunction (its address) of every kernel, loaded into `device`'s primary context
    (made current by the caller)."""
    functions = _loaded.get(device)
    if functions is None:
        module = gpu.load_module(cubin(device))
        _modules.append(module)  # loaded for the life of the process
        functions = _loaded[device] = {name: int(gpu.module_function(module, name))
                                       for name in kernel_names()}
    return functions
