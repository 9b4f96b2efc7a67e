"""The tune's report: every evaluated point as JSON and a markdown table, and a Pareto PNG of cost against each gate
metric, the uniform recipes on the same axes and the gate's thresholds drawn in."""
import json
from pathlib import Path

# gate key -> (the comparison's metric, its axis label)
GATED = {"max_kl": ("kl", "mean KL"), "min_recovery": ("recovery", "business recovery"),
         "max_perplexity_increase": ("perplexity_increase", "perplexity increase"), "min_agreement": ("agreement", "agreement")}


def write_tune_report(config, state, folder: Path, seconds: float, unit: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    points = sorted(state.points.values(), key=lambda point: point.cost)
    winner = state.winner and state.winner.name
    thresholds = config.eval.gate.model_dump(exclude_none=True)
    summary = {
        "winner": winner, "cost_unit": unit, "objective": config.objective if isinstance(config.objective, str)
        else config.objective.model_dump(), "gate": thresholds, "tune_s": seconds, "sensitivity_s": state.sensitivity_s,
        "evaluations": len(points), "units": len(state.units or []),
        "points": [{key: value for key, value in vars(point).items() if key != "choice"} for point in points],
        "winner_choice": None if winner is None else dict(zip([unit.label for unit in state.units], state.points[winner].choice)),
    }
    (folder / "tune.json").write_text(json.dumps(summary, indent=1) + "\n")
    chart = pareto_chart(points, thresholds, winner, unit, folder / "pareto.png")
    (folder / "report.md").write_text(markdown(points, thresholds, winner, unit, seconds, state.sensitivity_s, chart))


def markdown(points: list, thresholds: dict, winner: str | None, unit: str, seconds: float, sensitivity_s: float,
             chart: str | None) -> str:
    metrics = [metric for metric in ("perplexity", "perplexity_increase", "recovery", "agreement", "kl")
               if any(metric in point.metrics for point in points)]
    speed = any(point.tokens_per_second for point in points)
    drafted = any(point.accepted_length for point in points)
    header = ["point", "formats (units)", f"cost ({unit})", "predicted", *metrics, *(["batch-1 tok/s"] if speed else []),
              *(["draft accepted length"] if drafted else []), "gate"]
    lines = [f"# llmc tune: {len(points)} evaluations, {seconds / 60:.1f} min (sensitivity {sensitivity_s / 60:.1f} min)", "",
             f"Gate: {', '.join(f'{key} {value}' for key, value in thresholds.items())}. Winner: **{winner or 'none'}**.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for point in points:
        cells = [("**" + point.name + "**") if point.name == winner else point.name,
                 ", ".join(f"{label} {count}" for label, count in point.counts.items()), f"{point.cost:.4g}",
                 f"{point.predicted:.4g}", *(_cell(point.metrics.get(metric)) for metric in metrics)]
        if speed:
            cells.append(_cell(point.tokens_per_second, 1))
        if drafted:
            cells.append(_cell(point.accepted_length, 2))
        cells.append("pass" if point.passed else "fail")
        lines.append("| " + " | ".join(cells) + " |")
    if chart:
        lines += ["", f"![cost against each gate metric]({chart})"]
    return "\n".join(lines) + "\n"


def _cell(value: float | None, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def pareto_chart(points: list, thresholds: dict, winner: str | None, unit: str, path: Path) -> str | None:
    gated = [(key, *GATED[key]) for key in thresholds if key in GATED and any(GATED[key][0] in point.metrics for point in points)]
    if not points or not gated:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, len(gated), figsize=(5 * len(gated), 4), squeeze=False)
    try:
        for axis, (key, metric, label) in zip(axes[0], gated):
            for point in points:
                value = point.metrics.get(metric)
                if value is None:
                    continue
                style = dict(marker="s", color="tab:gray") if point.kind == "uniform" else dict(marker="o", color="tab:blue")
                if point.name == winner:
                    style = dict(marker="*", color="tab:red", s=160)
                axis.scatter(point.cost, value, **({"s": 40} | style))
                if point.kind == "uniform" or point.name == winner:
                    axis.annotate(point.name.removeprefix("uniform "), (point.cost, value), fontsize=7,
                                  xytext=(3, 3), textcoords="offset points")
            axis.axhline(thresholds[key], color="tab:red", linestyle="--", linewidth=0.8)
            axis.set_xlabel(f"cost ({unit})")
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
        figure.suptitle("llmc tune: squares uniform recipes, dots mixes, star the winner; dashed: the gate")
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
    return path.name
