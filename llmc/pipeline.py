"""`llmc quantize`: recipe -> model -> calibration -> layer-by-layer stages -> evals -> artifact."""
import json
import platform
import time
from dataclasses import asdict
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

import llmc
from llmc.artifact.compressed_tensors import quantization_config
from llmc.artifact.writer import ShardWriter, staged_folder, write_manifest
from llmc.calib.data import load_calibration
from llmc.calib.driver import build_skeleton, decoder_layers, layer_linears, quantize_layerwise
from llmc.errors import LlmcError
from llmc.evals.perplexity import load_eval_text, perplexity
from llmc.models.checkpoint import CheckpointReader
from llmc.models.families import family_for
from llmc.models.loading import load_model
from llmc.models.spec import resolve_model
from llmc.quant.qtypes import QuantArgs
from llmc.quant.stages import assign_linears, build_quantizers, check_group_sizes
from llmc.recipe import Recipe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LIBRARIES = ("torch", "transformers", "compressed-tensors", "safetensors", "datasets")


def export_dtype(recipe: Recipe, config) -> torch.dtype:
    if recipe.export.dtype != "auto":
        return DTYPES[recipe.export.dtype]
    source = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, source) if isinstance(source, str) else source


def plan_quantization(quantizers: list, skeleton, family) -> dict[str, QuantArgs]:
    """Which Linear gets which format, checked for the whole model before any weight is read."""
    plan: dict[str, QuantArgs] = {}
    per_stage_all: list[dict] = [{} for _ in quantizers]
    for index, layer in enumerate(decoder_layers(skeleton, family)):
        for stage_linears, chosen in zip(per_stage_all, assign_linears(quantizers, layer_linears(layer, f"{family.layers}.{index}"))):
            stage_linears.update(chosen)
    check_group_sizes(quantizers, per_stage_all)
    for quantizer, linears in zip(quantizers, per_stage_all):
        plan |= {name: quantizer.config.weights for name in linears}
    if not plan:
        raise LlmcError("the recipe's stages target no Linear layer; check their targets and ignore lists")
    return plan


def run_quantize(recipe: Recipe, overwrite: bool = False) -> Path:
    timings: dict[str, float] = {}
    started = time.perf_counter()
    output = Path(recipe.output)
    if output.exists() and not overwrite:
        raise LlmcError(f"output {output} already exists; remove it, choose --output, or pass --overwrite")
    folder = resolve_model(recipe.model)
    config = AutoConfig.from_pretrained(folder)
    family = family_for(config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dtype = export_dtype(recipe, config)
    quantizers = build_quantizers(recipe, dtype)
    skeleton = build_skeleton(AutoConfig.from_pretrained(folder))
    plan = plan_quantization(quantizers, skeleton, family)
    calibration = load_calibration(recipe.calibration, tokenizer) if recipe.calibration else None
    timings["prepare_s"] = time.perf_counter() - started

    with staged_folder(output, overwrite) as staging:
        reader = CheckpointReader(folder)
        num_layers = len(decoder_layers(skeleton, family))
        writer = ShardWriter(staging, num_layers + 1, dtype)
        started = time.perf_counter()
        reports = quantize_layerwise(reader, skeleton, config, family, quantizers, calibration, writer.write_layer)
        rest = {name: reader.tensor(name).to(dtype) for name in reader.file_of if not name.startswith(f"{family.layers}.")}
        writer.write(rest)
        writer.write_index()
        timings["quantize_s"] = time.perf_counter() - started
        all_linears = [name for name, module in skeleton.named_modules() if isinstance(module, torch.nn.Linear)]
        _write_config(folder, staging, quantization_config(plan, all_linears), dtype)
        tokenizer.save_pretrained(staging)
        (staging / "recipe.yaml").write_text(recipe.to_yaml())
        started = time.perf_counter()
        evals = run_recipe_evals(recipe, staging)
        timings["eval_s"] = time.perf_counter() - started
        write_manifest(staging, {
            "llmc_version": llmc.__version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": recipe.model,
            "libraries": {name: version(name) for name in LIBRARIES} | {"python": platform.python_version()},
            "export_dtype": str(dtype).removeprefix("torch."),
            "stages": [{"type": stage.type, "weights": stage.weights.describe()} for stage in recipe.stages],
            "calibration": None if calibration is None else {
                "dataset": calibration.source,
                "num_samples": calibration.input_ids.shape[0],
                "seq_len": calibration.input_ids.shape[1],
                "sha256": calibration.sha256,
            },
            "layers": [asdict(report) for report in reports],
            "timings": timings,
            "eval": evals,
        })
        if recipe.draft is not None:  # heads learn from the quantized model, the one that will be served
            from llmc.draft.build import train_draft

            train_draft(staging, recipe.draft)
    return output


def _write_config(source: Path, staging: Path, quantization: dict, dtype: torch.dtype) -> None:
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization
    config["dtype"] = str(dtype).removeprefix("torch.")
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = source / "generation_config.json"
    if generation.is_file():
        (staging / "generation_config.json").write_text(generation.read_text())


def run_recipe_evals(recipe: Recipe, artifact: Path) -> dict:
    settings = recipe.eval.perplexity
    if settings is None:
        return {}
    text = load_eval_text(settings.dataset)
    targets = {"artifact": str(artifact)} | ({"baseline": recipe.model} if recipe.eval.baseline else {})
    results = {}
    for role, target in targets.items():
        loaded = load_model(target)
        results[role] = perplexity(
            loaded.model, loaded.tokenizer, text, settings.dataset, settings.seq_len, settings.max_windows,
            label=f"perplexity ({role})",
        ).to_dict()
    return {"perplexity": results}
