"""The `ipc` backend: anyccl's own GPU kernels over CUDA IPC peer memory (one node)."""

from .backend import AUTO_IPC_RANGES, POLICIES, IpcBackend, routes_to_ipc

__all__ = ["AUTO_IPC_RANGES", "POLICIES", "IpcBackend", "routes_to_ipc"]
