"""What `import torch` runs through anyccl's ``torch.backends`` entry point: register the
"anyccl" torch.distributed backend, and never raise (an exception here would make ``import
torch`` fail; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns the entry point off)."""


def autoload() -> None:
    try:
        from . import torch  # noqa: F401 - importing it registers the backend
    except Exception:  # noqa: BLE001 - nothing may escape into torch's import
        pass
