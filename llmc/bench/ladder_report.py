"""The ladder's table (as the article prints it: rung, configuration, goodput, TTFT, memory, the ratio to the baseline,
and each rung's quality on the same line) and its PNG (goodput and memory per rung)."""
from pathlib import Path

from rich.table import Table

from llmc.bench.ladder import RungResult
from llmc.core.plot import saved_figure


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:,.0f}"


def ratio_to_baseline(result: RungResult, baseline: RungResult | None) -> tuple[float | None, bool]:
    """The rung's goodput over the baseline's, and whether it is a lower bound: where the baseline met the SLO at no rate
    tried, over the lowest rate it missed it at."""
    if baseline is None or baseline.error or not result.goodput:
        return None, False
    if baseline.goodput:
        return result.goodput / baseline.goodput, False
    return (result.goodput / baseline.lowest_missed, True) if baseline.lowest_missed else (None, False)


def _ratio(result: RungResult, baseline: RungResult | None) -> str:
    value, lower_bound = ratio_to_baseline(result, baseline)
    return "-" if value is None else f"{'> ' if lower_bound else ''}{value:.2f}"


VLLM_BESIDE = {"vllm": "llmc", "vllm-quantized": "quantized"}  # vLLM's rungs, shown in a column of the llmc rung they match


def _goodput(result: RungResult) -> str:
    if result.error:
        return "failed"
    if result.lowest_missed:
        return f"< {result.lowest_missed:.3g}"
    return f"{'>= ' if result.goodput_is_lower_bound else ''}{_cell(result.goodput, '.3g')}"


def ladder_table(results: list[RungResult], slo_text: str) -> Table:
    vllm = {VLLM_BESIDE[r.rung.name]: r for r in results if r.rung.name in VLLM_BESIDE}
    table = Table("rung", "configuration", "goodput req/s", "tok/s", "x baseline", "TTFT p50 / p90 ms",
                  "TPOT p50 / p90 ms", "memory MiB (weights + KV)", "recovery", "KL", "time s",
                  *(["vLLM req/s"] if vllm else []), title=f"llmc bench --ladder: goodput at {slo_text}")
    baseline = results[0] if results else None
    for result in results:
        if result.rung.name in VLLM_BESIDE:
            continue
        beside = [_goodput(vllm[result.rung.name]) if result.rung.name in vllm else ""] if vllm else []
        quality = result.quality or {}
        if result.error:
            table.add_row(result.rung.name, result.rung.configuration, f"[red]{result.error}[/]", *["-"] * 7,
                          f"{result.seconds:.0f}", *beside)
            continue
        table.add_row(
            result.rung.name, result.rung.configuration, _goodput(result),
            _cell(result.goodput_tokens_s, ".0f"), _ratio(result, baseline),
            f"{_cell(result.ttft_p50_ms, '.0f')} / {_cell(result.ttft_p90_ms, '.0f')}",
            f"{_cell(result.tpot_p50_ms, '.1f')} / {_cell(result.tpot_p90_ms, '.1f')}",
            f"{_mib(result.memory_bytes)} ({_mib(result.weights_bytes)} + {_mib(result.kv_bytes)})",
            _cell(quality.get("recovery"), ".3f"), _cell(quality.get("kl"), ".4f"),
            f"{result.seconds:.0f} of {result.budget_s:.0f}", *beside)
    for name, result in vllm.items():
        if result.error:
            table.caption = (table.caption or "") + f"vLLM beside {name}: {result.error}\n"
    return table


def ladder_png(results: list[RungResult], path: Path) -> None:
    names = [result.rung.name for result in results]
    goodput = [result.goodput or 0.0 for result in results]
    memory = [(result.memory_bytes or 0) / 2**20 for result in results]
    with saved_figure(path, (max(6.0, 1.1 * len(names)), 3.8)) as axis:
        positions = range(len(names))
        axis.bar([p - 0.2 for p in positions], goodput, width=0.4, color="tab:blue", label="goodput (req/s)")
        axis.set_ylabel("goodput at the SLO (req/s)")
        axis.set_xticks(list(positions), names, rotation=20)
        twin = axis.twinx()
        twin.bar([p + 0.2 for p in positions], memory, width=0.4, color="tab:orange", label="memory (MiB)")
        twin.set_ylabel("weights + KV cache (MiB)")
        axis.set_ylim(0, 1.3 * max(goodput, default=0) or 1)  # headroom for the legends
        twin.set_ylim(0, 1.3 * max(memory, default=0) or 1)
        for position, result in zip(positions, results):
            if result.error:
                axis.annotate("failed", (position, 0), ha="center", va="bottom", color="red")
        axis.legend(loc="upper left")
        twin.legend(loc="upper right")
        axis.set_title("optimisation ladder")
