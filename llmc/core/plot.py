from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def saved_figure(path: Path, size: tuple[float, float] = (6, 3.5)) -> Iterator:
    """One matplotlib axis, drawn off-screen and saved to path as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=size)
    try:
        yield axis
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
