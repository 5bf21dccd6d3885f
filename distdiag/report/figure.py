"""Images of reports through matplotlib, an optional extra (`pip install 'distdiag[plot]'`).

Shared by `analyze --plot`, `hang-report --graph FILE.png` and `gate --chart`: one way to ask
for pyplot (a one-line PlotUnavailable when matplotlib is missing, which the CLI turns into
exit 2), one list of image suffixes, and one atomic save that never writes through a link.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from distdiag.errors import DistDiagError
from distdiag.report.safefile import write_atomic

__all__ = ["IMAGE_SUFFIXES", "PlotUnavailable", "is_image_path", "pyplot", "save_figure", "SEVERITY_COLOURS"]

IMAGE_SUFFIXES = (".png", ".svg", ".pdf")
"""The image formats written (by the path's suffix); every matplotlib backend-free format we test."""

SEVERITY_COLOURS = {"info": "#9e9e9e", "warning": "#f28e00", "error": "#d62728", "critical": "#8b0000"}
"""One colour per severity in every picture: info grey, warning orange, error red."""


class PlotUnavailable(DistDiagError):
    """matplotlib is not installed."""


def is_image_path(path: str | Path) -> bool:
    """Whether `path` names an image we draw (.png, .svg, .pdf, any case)."""
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def pyplot(option: str) -> Any:
    """matplotlib.pyplot on the file-only Agg backend; PlotUnavailable naming `option` and the
    install command when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: the CLI writes a file
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(f"{option} needs matplotlib: pip install 'distdiag[plot]'") from None
    return plt


def save_figure(fig: Any, path: str | Path, option: str, dpi: int = 110) -> Path:
    """Write `fig` in the format of `path`'s suffix, atomically and never through a link
    (distdiag/report/safefile.py), and close it."""
    import matplotlib.pyplot as plt

    out = Path(path)
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=dpi, format=out.suffix[1:].lower() or "png")
    finally:
        plt.close(fig)
    return write_atomic(out, image.getvalue(), f"pass {option} a file path")
