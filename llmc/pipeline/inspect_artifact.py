"""What is inside an artifact, as a dict (for --json) and as rich tables."""
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmc.artifact.writer import MANIFEST
from llmc.core.errors import LlmcError
from llmc.evals.report import SUMMARY_COLUMNS, summary_rows


def describe_artifact(folder: Path) -> dict:
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise LlmcError(f"{folder} is not an llmc artifact (no {MANIFEST})")
    manifest = json.loads(manifest_path.read_text())
    config = json.loads((folder / "config.json").read_text())
    quantization = config.get("quantization_config", {})
    size = sum(path.stat().st_size for path in folder.glob("*.safetensors"))
    draft_config = folder / "draft" / "config.json"
    return {
        "path": str(folder),
        "architecture": (config.get("architectures") or ["?"])[0],
        "num_layers": config.get("num_hidden_layers"),
        "format": quantization.get("format"),
        "config_groups": {name: group["weights"] for name, group in quantization.get("config_groups", {}).items()},
        "input_activations": {
            name: group.get("input_activations") for name, group in quantization.get("config_groups", {}).items()
        },
        "kv_cache_scheme": quantization.get("kv_cache_scheme"),
        "ignore": quantization.get("ignore", []),
        "weights_bytes": size,
        "manifest": manifest,
        "draft": json.loads(draft_config.read_text()) if draft_config.is_file() else None,
    }


def print_artifact(info: dict, console: Console) -> None:
    manifest = info["manifest"]
    console.print(f"[bold]{info['path']}[/]  {info['architecture']}, {info['num_layers']} layers, "
                  f"{info['weights_bytes'] / 2**20:.1f} MiB of weights, format {info['format']}")
    console.print(f"model {manifest['model']}, llmc {manifest['llmc_version']}, created {manifest['created']}")
    groups = Table("group", "bits", "type", "symmetric", "strategy", "group size", "input activations", title="quantization")
    for name, weights in info["config_groups"].items():
        acts = info["input_activations"][name]
        timing = {True: "dynamic", "local": "dynamic local", False: "static"}[acts["dynamic"]] if acts else ""
        activations = f"{acts['type']}{acts['num_bits']} {acts['strategy']} {timing}" if acts else "-"
        groups.add_row(name, str(weights["num_bits"]), weights["type"], str(weights["symmetric"]),
                       weights["strategy"], str(weights.get("group_size") or "-"), activations)
    console.print(groups)
    kv = info["kv_cache_scheme"]
    if kv and kv["strategy"] == "tensor_group":
        console.print("KV cache: NVFP4 (float4 in groups of 16, one global scale per tensor)")
    elif kv:
        console.print(f"KV cache: {kv['type']}{kv['num_bits']}, one scale per {'head' if kv['strategy'] == 'attn_head' else 'tensor'}")
    console.print(f"left in full precision: {', '.join(info['ignore']) or 'nothing'}")
    calibration = manifest.get("calibration")
    console.print("calibration: " + (f"{calibration['num_samples']} x {calibration['seq_len']} tokens of "
                                      f"{calibration['dataset']} (sha256 {calibration['sha256'][:12]})" if calibration else "none"))
    evals = manifest.get("eval") or {}
    if evals:
        table = Table(*SUMMARY_COLUMNS, title=f"evals (baseline: {evals['baseline']})")
        for row in summary_rows(evals):
            table.add_row(*row)
        console.print(table)
    if "gate" in evals:
        console.print(f"gate {evals['gate']['thresholds']}: {'passed' if evals['gate']['passed'] else 'FAILED'}")
    console.print("timings: " + ", ".join(f"{key} {value:.1f}" for key, value in manifest["timings"].items()))
    draft = info["draft"]
    if draft:
        train = draft["train"]
        heads = f"{draft['num_heads']} x medusa" if draft["method"] == "medusa" else draft["method"]
        top1 = train.get("train_top1_per_head") or train["train_top1_per_step"]
        held_out = train.get("heldout_top1_per_head") or train.get("heldout_top1_per_step")
        console.print(f"draft heads: {heads} in draft/, trained {train['steps']} steps on "
                      f"{draft['trained_on']['answer_tokens']} self-distilled tokens ({draft['trained_on']['prompts']}); "
                      f"top-1 train {', '.join(f'{value:.2f}' for value in top1)}"
                      + (f", held out {', '.join(f'{value:.2f}' for value in held_out)}" if held_out else ""))
        acceptance = draft.get("heldout_acceptance")
        if acceptance:
            console.print(f"draft acceptance: mean accepted length {acceptance['mean_accepted_length']:.2f} on "
                          f"{acceptance['num_prompts']} held-out prompts, a chain of {acceptance['chain']}"
                          + ("; vLLM serves it from draft/vllm" if draft["method"] == "eagle3" else ""))
    else:
        console.print("draft heads: none (`llmc train-draft ARTIFACT` adds them)")
    console.print(f"files: {len(manifest['files'])} with SHA-256 in llmc.json")
