"""PNG charts of a side-by-side report; each is drawn only when its numbers were measured."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def write_charts(report: dict, folder: Path) -> list[str]:
    targets = report["targets"]
    others = [label for label in targets if label != report["baseline"]]
    written = []
    perplexities = {label: t["perplexity"]["perplexity"] for label, t in targets.items() if "perplexity" in t}
    if perplexities:
        written.append(_bars(folder / "perplexity.png", perplexities, "perplexity (lower is better)"))
    if any("business" in t for t in targets.values()):
        written.append(_tag_scores(folder / "business_by_tag.png", targets))
    recoveries = {label: targets[label]["vs_baseline"].get("recovery") for label in others}
    recoveries = {label: value for label, value in recoveries.items() if value is not None}
    if recoveries:
        written.append(_bars(folder / "recovery.png", recoveries, "business score recovery vs baseline", reference=1.0))
    kls = {label: targets[label]["vs_baseline"]["kl"] for label in others if "kl" in targets[label]["vs_baseline"]}
    if kls:
        written.append(_bars(folder / "kl.png", kls, "mean KL(baseline || target) per token (lower is better)"))
    return written


def _bars(path: Path, values: dict[str, float], title: str, reference: float | None = None) -> str:
    figure, axes = plt.subplots(figsize=(max(4, 1.6 * len(values)), 3.5))
    bars = axes.bar(range(len(values)), list(values.values()), color="tab:blue")
    axes.bar_label(bars, fmt="%.4g")
    axes.set_xticks(range(len(values)), [_short(label) for label in values], rotation=15, ha="right")
    if reference is not None:
        axes.axhline(reference, color="gray", linestyle="--", linewidth=1)
    axes.set_title(title)
    return _save(figure, path)


def _tag_scores(path: Path, targets: dict) -> str:
    labels = [label for label, t in targets.items() if "business" in t]
    tags = ["overall", *sorted({tag for label in labels for tag in targets[label]["business"]["tags"]})]
    width = 0.8 / len(labels)
    figure, axes = plt.subplots(figsize=(max(6, 0.9 * len(tags) * len(labels)), 4))
    for index, label in enumerate(labels):
        business = targets[label]["business"]
        scores = [business["score"] if tag == "overall" else business["tags"].get(tag, 0.0) for tag in tags]
        axes.bar([i + index * width for i in range(len(tags))], scores, width, label=_short(label))
    axes.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(tags))], tags, rotation=30, ha="right")
    axes.set_ylim(0, 1)
    axes.set_title("business score per tag")
    axes.legend(fontsize="small")
    return _save(figure, path)


def _save(figure, path: Path) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path.name


def _short(label: str) -> str:
    return label if len(label) <= 28 else "…" + label[-27:]
