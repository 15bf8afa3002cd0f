"""Optional dependencies: one message that names the extra to install when one is missing."""

from __future__ import annotations

import importlib.util


def missing(module: str, *, extra: str, feature: str) -> str | None:
    """None when `module` can be imported; else the line to show the user: what needs it and
    the install command that brings it (`extra` is anyccl's optional-dependency group)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or a None module
        found = False
    if found:
        return None
    return (f"{feature} needs {module}, which is not installed; install it with "
            f"`pip install \"anyccl[{extra}]\"` (or `pip install {module}`)")
