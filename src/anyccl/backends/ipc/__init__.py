"""The `ipc` backend: anyccl's own GPU kernels over CUDA IPC peer memory (one node)."""

from .backend import POLICIES, IpcBackend
from .routes import Routes, Shape

__all__ = ["POLICIES", "IpcBackend", "Routes", "Shape"]
