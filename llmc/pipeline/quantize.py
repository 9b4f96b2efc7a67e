"""`llmc quantize`: recipe -> model -> calibration -> layer-by-layer stages -> evals -> artifact."""
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

import llmc
from llmc.artifact.export import exporter_for
from llmc.artifact.export_config import ExportConfig
from llmc.artifact.reader import layout_of
from llmc.artifact.resume import REPORT_DIR, Journal, journaled, resumable_staging, resumed_journal, resumption, run_fingerprint
from llmc.artifact.writer import COMPLETE, DRAFT, EVALS, RECIPE, WRITTEN, ShardWriter, staged_folder, write_manifest
from llmc.calib.data import load_calibration
from llmc.calib.driver import (
    LayerwiseQuantization,
    SourceModel,
    build_skeleton,
    decoder_layers,
    decoder_linears,
    quantize_layerwise,
)
from llmc.calib.memory import estimate_memory, require_fits
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import family_for
from llmc.checkpoints.spec import resolve_model
from llmc.core.device import describe_device, peak_memory, rank_device, resolve_device
from llmc.core.errors import LlmcError
from llmc.evals.gate import GateFailed, require_gate_passed
from llmc.evals.inputs import EvalInputs
from llmc.evals.report import summary, write_report
from llmc.evals.suite import EvalTarget, evaluate_side_by_side
from llmc.pipeline.preflight import resolve_eval_and_draft_inputs, resolved
from llmc.pipeline.recipe import Recipe
from llmc.quant.lm_head import quantize_lm_head
from llmc.quant.plan import build_plan
from llmc.quant.ranks import ranks_from_environment
from llmc.quant.stage import StageRole, source_of, stage_type_of, start_stage

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LIBRARIES = ("torch", "transformers", "compressed-tensors", "safetensors", "datasets")


@dataclass
class RunFacts:
    """What the manifest says of this run beyond its layers, phases and evals."""

    described: dict  # the model, libraries, dtype, stages, KV cache and calibration
    ranks: int
    estimate: dict  # the memory estimated before the work
    prepare_s: float


def export_dtype(export: ExportConfig, config) -> torch.dtype:
    if export.dtype != "auto":
        return DTYPES[export.dtype]
    source = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, source) if isinstance(source, str) else source


def run_quantize(recipe: Recipe, overwrite: bool = False, eval_inputs: EvalInputs | None = None, resume: bool = False,
                 discard_partial: bool = False) -> Path:
    """eval_inputs: resolve_eval_and_draft_inputs(recipe, overwrite, resume, discard_partial), when the caller resolved
    them already. resume: continue a stopped or killed run of the same recipe after its last finished layer or phase.
    discard_partial: remove the work such runs kept, and start again."""
    started = time.perf_counter()
    output = Path(recipe.output)
    eval_inputs = eval_inputs or resolve_eval_and_draft_inputs(recipe, overwrite, resume, discard_partial)
    device = rank_device(resolve_device(recipe.device))
    ranks = ranks_from_environment(device)
    if resume and ranks.distributed:
        raise LlmcError("--resume runs in one process: resume without --nproc or torchrun")
    say = print if ranks.rank == 0 else (lambda *args, **kwargs: None)
    say(f"device: {describe_device(device)}" + (f", {ranks.world_size} ranks" if ranks.distributed else ""), file=sys.stderr)
    folder = resolved(recipe, ("model",), lambda: resolve_model(recipe.model))
    config = AutoConfig.from_pretrained(folder)
    family = family_for(config)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if recipe.draft is not None:  # what the draft stage will need, checked before the quantization it follows
        from llmc.draft.build import checked_draft_inputs

        resolved(recipe, ("draft",), lambda: checked_draft_inputs(folder, recipe.draft, device))
    dtype = export_dtype(recipe.export, config)
    kv_cache = recipe.kv_cache.args if recipe.kv_cache else None
    exporter = exporter_for(recipe.export, kv_cache, recipe.gptq_dampening_frac)
    stages = [start_stage(stage, exporter.scale_dtype or dtype, family) for stage in recipe.stages]
    skeleton = build_skeleton(config)
    reader = source_of(stages, CheckpointReader(folder), skeleton, config)  # a stage that cannot change this model says so now
    config_changes = {key: value for stage in stages for key, value in stage.config_changes(config).items()}
    plan = build_plan(stages, decoder_linears(skeleton, family), kv_only=not recipe.stages)
    if recipe.lm_head is not None:
        plan.weights[family.lm_head] = recipe.lm_head.weights
        config_changes["tie_word_embeddings"] = False  # the head is a quantized Linear of its own
    calibration = None
    if recipe.calibration:
        calibration = resolved(recipe, ("calibration", "dataset"), lambda: load_calibration(recipe.calibration, tokenizer))
    num_samples, seq_len = calibration.input_ids.shape if calibration is not None else (0, 0)
    if ranks.distributed and num_samples < ranks.world_size:
        raise LlmcError(f"{ranks.world_size} ranks share {num_samples} calibration samples: give each rank one at least")
    rank_samples = len(range(num_samples)[ranks.samples(num_samples)])
    estimate = estimate_memory(config, [stage.type for stage in recipe.stages], rank_samples, seq_len, device)
    say(estimate.describe() + (" per rank" if ranks.distributed else ""), file=sys.stderr)
    require_fits(estimate, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    fingerprint = run_fingerprint(recipe.model_dump(mode="json"), calibration and calibration.sha256, llmc.__version__)
    adopt = resumable_staging(output, fingerprint) if resume else None
    all_linears = [name for name, module in skeleton.named_modules() if isinstance(module, torch.nn.Linear)]
    quantization_config = exporter.config(plan, all_linears)
    run = RunFacts(describe_run(recipe, dtype, calibration), ranks.world_size, estimate.to_dict(), time.perf_counter() - started)
    layerwise = LayerwiseQuantization(stages, plan, calibration, kv_cache, device, dtype, ranks)
    if ranks.rank != 0:  # the same layers as rank 0, which alone writes them
        quantize_layerwise(SourceModel(reader, skeleton, config, family), layerwise)
        return output

    with staged_folder(output, overwrite, adopt) as staging:
        journal = resumed_journal(staging, fingerprint) if adopt else Journal(staging, fingerprint)
        if WRITTEN not in journal.phases:
            started = time.perf_counter()
            num_layers = len(decoder_layers(skeleton, family))
            writer = ShardWriter(staging, num_layers + 1, dtype, exporter.tensors)
            writer.restore([(layer.shard, layer.tensor_bytes) for layer in journal.finished])
            quantize_layerwise(SourceModel(reader, skeleton, config, family), layerwise, journaled(writer, journal),
                               resumption(journal, layout_of(quantization_config)))
            quantize_memory = peak_memory(device)
            head = f"{family.lm_head}.weight"
            rest = reader.tensors([name for name in reader.file_of if not name.startswith(f"{family.layers}.")
                                   and not (recipe.lm_head is not None and name == head)])
            rest = {name: tensor.to(dtype) for name, tensor in rest.items()}
            if recipe.lm_head is not None:
                rest |= exporter.tensors(family.lm_head, quantize_lm_head(reader, family, recipe.lm_head, exporter.scale_dtype or dtype))
            writer.write(rest)
            writer.write_index()
            _write_config(folder, staging, quantization_config, dtype, config_changes)
            for name in exporter.extra_files:
                (staging / name).write_text(json.dumps(quantization_config, indent=2, sort_keys=True) + "\n")
            tokenizer.save_pretrained(staging)
            (staging / RECIPE).write_text(recipe.to_yaml())
            journal.record_written({"quantize_s": time.perf_counter() - started, "memory": quantize_memory})
        if COMPLETE not in journal.phases:
            try:
                finish_artifact(recipe, staging, journal, eval_inputs, device, run)
            except GateFailed:
                journal.discard()  # a verdict on the finished work, not a fault: nothing to resume
                raise
    return output


def finish_artifact(recipe: Recipe, staging: Path, journal: Journal, eval_inputs: EvalInputs, device: torch.device,
                    run: "RunFacts") -> None:
    """The written model's evals, its manifest, then its draft, each recorded in the journal: a resumed run goes on
    from the first not done."""
    output = Path(recipe.output)
    if EVALS not in journal.phases:
        started = time.perf_counter()
        evals = run_recipe_evals(recipe, staging, output, eval_inputs, device)
        journal.record_phase(EVALS, {"summary": evals, "eval_s": time.perf_counter() - started})
    written, evals = journal.phases[WRITTEN], journal.phases[EVALS]
    write_manifest(staging, {
        "llmc_version": llmc.__version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        **run.described,
        "layers": [asdict(layer.report) for layer in journal.finished],
        "device": str(device),
        "ranks": run.ranks,
        "memory": written["memory"] | {"estimate": run.estimate},
        "timings": {"prepare_s": run.prepare_s, "quantize_s": written["quantize_s"], "eval_s": evals["eval_s"]},
        "eval": evals["summary"],
    })
    if recipe.draft is not None:  # heads learn from the quantized model, the one that will be served
        from llmc.draft.build import train_draft
        from llmc.evals.gate import check_accepted_length
        from llmc.runtime.speculative.store import read_draft_config

        journal.record_phase(DRAFT, {"started": datetime.now(UTC).isoformat(timespec="seconds")})
        folder = train_draft(staging, recipe.draft, device)
        if recipe.eval.gate is not None:
            acceptance = read_draft_config(folder)["heldout_acceptance"] or {}
            check_accepted_length(acceptance.get("mean_accepted_length", 1.0), recipe.eval.gate,
                                  f"the draft on its held-out prompts, no artifact written to {output}")
    journal.record_phase(COMPLETE, {})


def describe_run(recipe: Recipe, dtype: torch.dtype, calibration) -> dict:
    return {
        "model": recipe.model,
        "libraries": {name: version(name) for name in LIBRARIES} | {"python": platform.python_version()},
        "export_dtype": str(dtype).removeprefix("torch."),
        "stages": [_describe_stage(stage) for stage in recipe.stages],
        "kv_cache": None if recipe.kv_cache is None else recipe.kv_cache.model_dump(),
        "lm_head": None if recipe.lm_head is None else recipe.lm_head.weights.describe(),
        "calibration": None if calibration is None else {
            "dataset": calibration.source,
            "num_samples": calibration.input_ids.shape[0],
            "seq_len": calibration.input_ids.shape[1],
            "dtype": str(calibration.compute_dtype).removeprefix("torch."),
            "sha256": calibration.sha256,
        },
    }


def _describe_stage(stage) -> dict:
    described = {"type": stage.type}
    if stage_type_of(stage).role is StageRole.WEIGHT:
        described["weights"] = stage.weights.describe()
        if stage.input_activations is not None:
            described["input_activations"] = stage.input_activations.describe()
    return described


def _write_config(source: Path, staging: Path, quantization: dict, dtype: torch.dtype, changes: dict) -> None:
    config = json.loads((source / "config.json").read_text()) | changes
    config["quantization_config"] = quantization
    config["dtype"] = str(dtype).removeprefix("torch.")
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = source / "generation_config.json"
    if generation.is_file():
        (staging / "generation_config.json").write_text(generation.read_text())


def run_recipe_evals(recipe: Recipe, staging: Path, output: Path, inputs: EvalInputs, device: torch.device) -> dict:
    """The recipe's evals on the staged artifact (and the baseline): the report goes into the artifact's
    `report/`; when the gate fails it goes beside the output path instead and nothing is written."""
    settings = recipe.eval
    if not (settings.perplexity or settings.business or settings.tasks):
        return {}
    targets = [EvalTarget("baseline", recipe.model)] if settings.baseline else []
    report = evaluate_side_by_side([*targets, EvalTarget("artifact", str(staging))], settings, inputs, device)
    report["targets"]["artifact"]["target"] = str(output)
    try:
        require_gate_passed(report, f"gate failed, no artifact written to {output}")
    except GateFailed as failed:
        beside = write_report(report, output.with_name(f"{output.name}.gate-report"))
        raise GateFailed(f"{failed}\nreport: {beside / 'report.md'}") from None
    write_report(report, staging / REPORT_DIR)
    return summary(report)
