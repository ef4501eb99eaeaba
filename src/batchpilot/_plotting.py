"""PNG figures on bare matplotlib ``Figure`` objects, shared by the LR range test and the bench plots.

No pyplot and no display: drawing a PNG never touches pyplot's state or the process's backend, so a
notebook's inline plots keep working. matplotlib is imported lazily (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._extras import install_hint

__all__ = ["Figures", "figures", "finish", "save"]


class Figures:
    """The few pyplot calls the plots make, on bare ``matplotlib.figure.Figure`` objects."""

    def __init__(self, matplotlib: Any) -> None:
        self._matplotlib = matplotlib

    def subplots(self, *args: Any, figsize: tuple[float, float] | None = None, **kwargs: Any) -> tuple[Any, Any]:
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize)
        return fig, fig.subplots(*args, **kwargs)

    def get_cmap(self, name: str) -> Any:
        return self._matplotlib.colormaps[name]

    def close(self, fig: Any) -> None:
        fig.clear()  # a bare Figure is not registered with pyplot: dropping it frees it


def figures() -> Figures:
    """Figure factory for the PNGs (matplotlib imported here, lazily).

    Raises:
        ImportError: matplotlib is missing (names the extra to install).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            f"plotting needs matplotlib, an optional extra of batchpilot; install it with: {install_hint('plot')}"
        ) from exc
    return Figures(matplotlib)


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    figures().close(fig)


def finish(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str, *, legend: str | None = "best",
           legend_size: int = 7, grid: str = "both") -> None:
    """Label the axes, add the grid (``grid``: which ticks) and the legend (``None``: none), and save."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which=grid)
    if legend is not None:
        ax.legend(loc=legend, fontsize=legend_size)
    save(fig, path)
