"""Import an optional framework or fail with the pip command that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from .._extras import install_hint


def require(module: str, extra: str, *, what: str) -> ModuleType:
    """Import ``module``; if it is missing, raise an ImportError naming the batchpilot extra to install.

    Raises:
        ImportError: ``module`` is not installed (the message says ``pip install "batchpilot[<extra>]"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == module.split(".")[0]
        if not missing:  # installed, but it (or one of its own dependencies) fails to import
            raise ImportError(f"{what} needs the {module!r} package, which is installed but fails to import "
                              f"({type(exc).__name__}: {exc}); reinstall it with: {install_hint(extra)}") from exc
        raise ImportError(
            f"{what} needs the {module!r} package, which is not installed; install it with: {install_hint(extra)}"
        ) from exc
