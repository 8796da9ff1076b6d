"""The commands' plots: matplotlib when it is installed (the ``plot`` extra), else a line
saying which plot was not written; the JSON and tables are written either way."""

from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save"]


def pyplot(what: str):
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` (after saying that
    ``what`` is not written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 'megatron-domino[plot]'): {what}")
        return None
    return plt


def save(fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
