"""A side-by-side report on disk: report.json (everything), report.md (tables and charts) and PNG charts."""
import json
from pathlib import Path

from rich.table import Table

from llmc.evals.charts import write_charts

MAX_DIFFERING_ITEMS = 15


def write_report(report: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    charts = write_charts(report, folder)
    (folder / "report.md").write_text(render_markdown(report, charts))
    return folder


def summary(report: dict) -> dict:
    """The report without per-item answers: what the artifact's manifest keeps."""
    targets = {
        label: {key: ({k: v for k, v in value.items() if k != "items"} if key == "business" else value)
                for key, value in result.items()}
        for label, result in report["targets"].items()
    }
    return {**report, "targets": targets}


def summary_rows(report: dict) -> list[list[str]]:
    """One row per target: perplexity, business score, and the comparison with the baseline."""
    rows = []
    for label, result in report["targets"].items():
        comparison = result.get("vs_baseline", {})
        rows.append([
            label,
            _number(result.get("perplexity", {}).get("perplexity")),
            _percent(comparison.get("perplexity_increase"), signed=True),
            _number(result.get("business", {}).get("score")),
            _percent(comparison.get("recovery")),
            _percent(comparison.get("agreement")),
            _number(comparison.get("kl")),
        ])
    return rows


SUMMARY_COLUMNS = ["target", "perplexity", "ppl change", "business score", "recovery", "agreement", "mean KL"]


def render_markdown(report: dict, charts: list[str]) -> str:
    targets = report["targets"]
    lines = [f"# llmc eval report\n\nBaseline: `{report['baseline']}`.\n", "## Summary\n"]
    lines += _table(SUMMARY_COLUMNS, summary_rows(report))
    business = {label: t["business"] for label, t in targets.items() if "business" in t}
    if business:
        tags = sorted({tag for result in business.values() for tag in result["tags"]})
        lines += ["\n## Business score per tag\n"]
        lines += _table(["tag", *business], [[tag, *(_number(r["tags"].get(tag)) for r in business.values())] for tag in tags])
        lines += _differing_items(report["baseline"], business)
    tasks = {label: t["lm_eval"] for label, t in targets.items() if "lm_eval" in t}
    if tasks:
        first = next(iter(tasks.values()))
        keys = [(task, metric) for task, metrics in first.items() for metric in metrics]
        lines += ["\n## lm-eval tasks\n"]
        lines += _table(["task / metric", *tasks], [[f"{t} / {m}", *(_number(r[t][m]["value"]) for r in tasks.values())] for t, m in keys])
    if "gate" in report:
        gate = report["gate"]
        lines += [f"\n## Gate: {'PASSED' if gate['passed'] else 'FAILED'}\n",
                  "Thresholds: " + ", ".join(f"`{k}: {v}`" for k, v in gate["thresholds"].items()) + "\n"]
        lines += [f"- {failure}" for failure in gate["failures"]]
    if charts:
        lines += ["\n## Charts\n", *(f"![{chart}]({chart})" for chart in charts)]
    return "\n".join(lines) + "\n"


def _differing_items(baseline: str, business: dict) -> list[str]:
    base_items = business[baseline]["items"]
    rows = []
    for label, result in business.items():
        for base, item in zip(base_items, result["items"]):
            if label != baseline and item["score"] != base["score"]:
                rows.append([label, item["id"], f"{base['score']:.2f} → {item['score']:.2f}", _cell(base["output"]), _cell(item["output"])])
    if not rows:
        return []
    lines = [f"\n## Items scored differently from the baseline ({len(rows)}; first {MAX_DIFFERING_ITEMS})\n"]
    return lines + _table(["target", "item", "score", "baseline answer", "target answer"], rows[:MAX_DIFFERING_ITEMS])


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(row) + " |" for row in rows)]


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _percent(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{value:+.2%}" if signed else f"{value:.1%}"


def summary_table(report: dict, title: str) -> Table:
    table = Table(*SUMMARY_COLUMNS, title=title)
    for row in summary_rows(report):
        table.add_row(*row)
    return table
