"""The torch process group's compiled part (`_torchcore.cpp`), built on first use.

What each operation of anyccl's torch process group does around anyccl's own call -- switch to
the group's stream after the caller's, mark the tensors used there, make the torch Work and its
future -- costs about as much host time as the call itself when written in Python, and a future
completed from Python holds a Python object that torch pickles to find its tensors. The compiled
part does the same in two calls per operation, and its futures hold typed tensors.

It is built against the torch in use, with the machine's C++ compiler (``$CXX``, else ``c++``),
the first time a process group needs it, and kept under the cache directory (`ANYCCL_CACHE_DIR`,
default ~/.cache/anyccl) named by a hash of the source, the torch version and the Python ABI;
later processes load it from there. Where it cannot be built (no compiler, no torch headers) or
`ANYCCL_TORCH_CORE=0`, the group runs its Python code, which keeps the same promises.
`anyccl info` says which one runs and why.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from . import settings

SOURCE = Path(__file__).with_name("_torchcore.cpp")
BUILD_TIMEOUT_S = 600.0

_state: dict[str, object] = {}


def cache_path() -> Path:
    """Where the compiled part for this torch, Python and source is kept."""
    import torch

    root = settings.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "anyccl")
    key = "\n".join((SOURCE.read_text(), torch.__version__, os.path.dirname(torch.__file__),
                     sysconfig.get_config_var("EXT_SUFFIX") or "", sys.version))
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(root) / "torch" / f"_torchcore-{digest}{sysconfig.get_config_var('EXT_SUFFIX')}"


def _command(out: str) -> list[str]:
    """The compiler's command line that builds the part into `out`."""
    import torch

    named = os.environ.get("CXX")
    compiler = shutil.which(named) if named else shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise OSError(f"no C++ compiler ({f'CXX={named} is not one' if named else 'no c++ or g++'}"
                      f" on PATH; install g++ or set CXX)")
    root = Path(torch.__file__).parent
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include",
                Path(sysconfig.get_paths()["include"])]
    if not (root / "include" / "torch" / "csrc" / "distributed" / "c10d" / "Work.hpp").exists():
        raise OSError(f"torch {torch.__version__} at {root} ships no C++ headers")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
            "-DTORCH_EXTENSION_NAME=_torchcore", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in includes), str(SOURCE), "-o", out, f"-L{root / 'lib'}",
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{root / 'lib'}"]


def _build(path: Path) -> None:
    """Compile the part into `path`: one process builds, the others wait on the lock and then
    find it there; written under a temporary name and renamed, so no reader sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
        os.close(fd)
        try:
            done = subprocess.run(_command(tmp), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode:
                raise OSError(f"the compiler failed ({done.returncode}): "
                              f"{done.stderr.strip()[-600:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("anyccl._torchcore", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The compiled part (built first if it is not in the cache), or None where it is off or
    cannot be built (`status()` says why). Looked up once per process."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    module, why = None, ""
    if not settings.TORCH_CORE.get():
        why = "the compiled part is off (ANYCCL_TORCH_CORE=0)"
    else:
        try:
            path = cache_path()
            if not path.exists():
                _build(path)
            module = _import(path)
            why = f"compiled, {path}"
        except (OSError, ImportError, subprocess.SubprocessError) as exc:
            why = f"the compiled part was not built ({exc})"
    _state["module"], _state["why"] = module, why
    return module


def built() -> ModuleType | None:
    """The compiled part where it is loaded or already in the cache (loaded from there), else
    None: never builds it (for callers that must not wait for a compiler)."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    try:
        if not settings.TORCH_CORE.get() or not cache_path().exists():
            return None
    except (OSError, ImportError):
        return None
    return load()


def status() -> str:
    """Which code runs the torch group's operations, and why (`anyccl info`), without building
    anything: where the part is not built yet, whether it can be."""
    if "module" in _state:
        prefix = "" if _state["module"] is not None else "the group's Python code: "
        return f"{prefix}{_state['why']}"
    if not settings.TORCH_CORE.get():
        return "the group's Python code: the compiled part is off (ANYCCL_TORCH_CORE=0)"
    try:
        path = cache_path()
        if path.exists():
            return f"compiled, {path}"
        _command(str(path))   # raises where it cannot be built
    except (OSError, ImportError) as exc:
        return f"the group's Python code: the compiled part cannot be built ({exc})"
    return f"compiled, built on first use into {path.parent}"
