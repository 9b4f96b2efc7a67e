"""W4A16 (group 64) methods, with --suite w8a8 the 8-bit weight-and-activation formats (W8A8 int8 with and
without SmoothQuant, FP8 dynamic / static / block) and the FP8 KV cache, or with --suite formats the newer presets
(NVFP4, MXFP4, MXFP8, W4A8, W4AFP8, W3A16, W2A16; int ones at group 64, which divides SmolLM2's widths), by RTN and
with GPTQ and the mse observer, on SmolLM2-135M-Instruct, side by side:
perplexity on WikiText-2 (first N windows of 1,024 tokens), its increase over fp32, quantization wall and CPU time
(process start to artifact written, model loading included; CPU time is the fairer figure on a shared machine) and
the quantizing process's peak RSS. Calibration: Spec-Bench's non-MT-bench prompts, the same token windows for every
method. Where `llmcompressor` is installed (here, or in the venv whose python --llmcompressor-python names) its
GPTQ, AWQ and presets run on the same model, samples and windows. The depth figure with GPTQ (8 vs 32 layers):
`python benchmarks/layerwise_memory.py --stage gptq`.

    python benchmarks/quantize.py [--suite w4a16|w8a8|formats] [--samples 128] [--seq-len 512] [--windows 40]
        [--only GPTQ ...] [--fp32-perplexity P] [--llmcompressor-python PATH] [--business FILE [--business-limit N]]
        [--keep DIR]
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def weights(symmetric: bool = True, actorder: str | None = None, observer: str = "minmax") -> str:
    order = f", actorder: {actorder}" if actorder else ""
    return f"    scheme: {'W4A16' if symmetric else 'W4A16_ASYM'}\n    weights: {{group_size: 64{order}, observer: {observer}}}\n"


AWQ, AWQ_CLIP = "  - type: awq\n", "  - type: awq\n    clip_search: true\n"
LLMC = {
    "RTN": "  - type: rtn\n" + weights(),
    "RTN asym": "  - type: rtn\n" + weights(False),
    "RTN mse": "  - type: rtn\n" + weights(observer="mse"),
    "GPTQ": "  - type: gptq\n" + weights(),
    "GPTQ act-order": "  - type: gptq\n" + weights(actorder="static"),
    "GPTQ asym act-order": "  - type: gptq\n" + weights(False, "static"),
    "GPTQ act-order mse": "  - type: gptq\n" + weights(actorder="static", observer="mse"),
    "GPTQ asym act-order mse": "  - type: gptq\n" + weights(False, "static", "mse"),
    "AWQ": AWQ + "  - type: rtn\n" + weights(),
    "AWQ clip": AWQ_CLIP + "  - type: rtn\n" + weights(),
    "AWQ clip asym": AWQ_CLIP + "  - type: rtn\n" + weights(False),
    "AWQ+GPTQ": AWQ + "  - type: gptq\n" + weights(actorder="static"),
    "AWQ+GPTQ mse": AWQ + "  - type: gptq\n" + weights(actorder="static", observer="mse"),
}
LLMCOMPRESSOR = {"llm-compressor GPTQ": ("gptq", True), "llm-compressor GPTQ act-order": ("gptq-static", True),
                 "llm-compressor AWQ": ("awq", True), "llm-compressor AWQ asym": ("awq", False)}
W8A8_STAGES = {
    "naive W8A8": "  - type: rtn\n    scheme: W8A8\n",
    "SmoothQuant W8A8 a0.5": "  - type: smoothquant\n    alpha: 0.5\n  - type: rtn\n    scheme: W8A8\n",
    "SmoothQuant W8A8 a0.8": "  - type: smoothquant\n    alpha: 0.8\n  - type: rtn\n    scheme: W8A8\n",
    "SmoothQuant+GPTQ W8A8": "  - type: smoothquant\n  - type: gptq\n    scheme: W8A8\n",
    "FP8 dynamic": "  - type: rtn\n    scheme: FP8_DYNAMIC\n",
    "SmoothQuant FP8 dynamic": "  - type: smoothquant\n    alpha: 0.5\n  - type: rtn\n    scheme: FP8_DYNAMIC\n",
    "FP8 static": "  - type: rtn\n    scheme: FP8\n",
    "FP8 block": "  - type: rtn\n    scheme: FP8_BLOCK\n",
}
NEW_PRESETS = ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8", "W4A8", "W4AFP8", "W3A16", "W2A16"]


def preset_stage(algorithm: str, preset: str, observer: str = "minmax", actorder: str | None = None) -> str:
    fields = [f"observer: {observer}"] + (["group_size: 64"] if preset.startswith("W") else [])
    fields += [f"actorder: {actorder}"] if actorder else []
    return f"  - type: {algorithm}\n    scheme: {preset}\n    weights: {{{', '.join(fields)}}}\n"


FORMAT_STAGES = {f"{preset} RTN": preset_stage("rtn", preset) for preset in NEW_PRESETS} | {
    f"{preset} GPTQ mse": preset_stage("gptq", preset, "mse") for preset in NEW_PRESETS
} | {f"{preset} GPTQ": preset_stage("gptq", preset) for preset in NEW_PRESETS} | {
    # llm-compressor 0.14's GPTQModifier orders columns by static act-order unless told otherwise: these rows do the same
    f"{preset} GPTQ act-order{suffix}": preset_stage("gptq", preset, observer, "static")
    for preset in NEW_PRESETS for suffix, observer in (("", "minmax"), (" mse", "mse"))
} | {
    "W4A8 SmoothQuant GPTQ mse": "  - type: smoothquant\n" + preset_stage("gptq", "W4A8", "mse"),
    "W4AFP8 SmoothQuant GPTQ mse": "  - type: smoothquant\n" + preset_stage("gptq", "W4AFP8", "mse"),
    "W4A16 GPTQ mse": preset_stage("gptq", "W4A16", "mse"), "fp32 + NVFP4 KV": "stages: []\nkv_cache: {dtype: nvfp4}\n"}
LOW_BIT = ["W4A16", "W3A16", "W2A16"]
BF16_PASSES = "  dtype: bfloat16\n"  # continues the calibration section: forward passes in bfloat16


def autoround_body(preset: str, observer: str = "minmax", passes: str = BF16_PASSES, fields: str = "") -> str:
    """STEPS: --autoround-steps, the same as auto-round's iters; bfloat16 passes by default, as auto-round's CPU
    default (amp)."""
    return f"{passes}stages:\n{preset_stage('autoround', preset, observer)}    steps: STEPS\n{fields}"


GRID = "    full_range: false\n"  # round-to-nearest's grid instead of auto-round's full range
AUTOROUND_BODIES = {f"{preset} RTN": f"stages:\n{preset_stage('rtn', preset)}" for preset in LOW_BIT} | {
    f"{preset} GPTQ act-order mse": f"stages:\n{preset_stage('gptq', preset, 'mse', 'static')}" for preset in LOW_BIT
} | {f"{preset} AutoRound": autoround_body(preset) for preset in LOW_BIT} | {
    "W4A16 AutoRound grid": autoround_body("W4A16", fields=GRID),
    "W4A16 AutoRound grid mse": autoround_body("W4A16", "mse", fields=GRID),
    "W4A16 AutoRound grid fp32 passes": autoround_body("W4A16", passes="", fields=GRID),
}
ROTATED_PRESETS = ["W4A8", "W4AFP8", "NVFP4", "W8A8"]
ROTATE = "  - type: rotate\n"
ROTATE_STAGES = {f"{preset} RTN": preset_stage("rtn", preset) for preset in [*ROTATED_PRESETS, "W4A16"]} | {
    f"rotate {preset} RTN": ROTATE + preset_stage("rtn", preset) for preset in [*ROTATED_PRESETS, "W4A16"]
} | {f"rotate R2 {preset} RTN": "  - type: rotate\n    rotations: [R2]\n" + preset_stage("rtn", preset) for preset in ("W4A8",)} | {
    f"rotate {preset} GPTQ mse": ROTATE + preset_stage("gptq", preset, "mse") for preset in ("W4A8", "W4AFP8")
}
SUITES = {
    "w4a16": ({name: f"stages:\n{stages}" for name, stages in LLMC.items()}, LLMCOMPRESSOR),
    "w8a8": (
        {name: f"stages:\n{stages}" for name, stages in W8A8_STAGES.items()} | {
            "SmoothQuant W8A8 a0.5 bf16 passes": f"{BF16_PASSES}stages:\n{W8A8_STAGES['SmoothQuant W8A8 a0.5']}",
            "fp32 + FP8 KV": "stages: []\nkv_cache: {dtype: fp8}\n",
        },
        {"llm-compressor W8A8": ("w8a8", True), "llm-compressor SmoothQuant W8A8 a0.8": ("smoothquant-w8a8", True),
         "llm-compressor FP8 dynamic": ("fp8-dynamic", True)},
    ),
}
SUITES["formats"] = (
    {name: stages if stages.startswith("stages:") else f"stages:\n{stages}" for name, stages in FORMAT_STAGES.items()},
    {f"llm-compressor {preset} RTN": (f"preset-{preset}", True) for preset in NEW_PRESETS}
    | {f"llm-compressor {preset} GPTQ": (f"gptq-preset-{preset}", True) for preset in [*NEW_PRESETS, "W4A16"]}
    | {"llm-compressor fp32 + NVFP4 KV": ("kv-nvfp4", True)},
)
SUITES["autoround"] = (
    AUTOROUND_BODIES,
    {f"auto-round {preset}": (f"autoround-{preset}", True) for preset in LOW_BIT},
)
SUITES["rotate"] = (
    {name: f"stages:\n{stages}" for name, stages in ROTATE_STAGES.items()},
    {f"llm-compressor SpinQuant {preset} RTN": (f"spinquant-preset-{preset}", True) for preset in ROTATED_PRESETS},
)
TITLES = {"w4a16": "W4A16 g64", "w8a8": "8-bit weights and activations, FP8 KV cache",
          "formats": "NVFP4, MXFP4, MXFP8, W4A8, W4AFP8, W3A16, W2A16 (int presets at group 64)",
          "autoround": "AutoRound against GPTQ and RTN, and auto-round 0.16, at 4, 3 and 2 bits (group 64)",
          "rotate": "R1 + R2 Hadamard rotations before the activation-quantized formats, and llm-compressor's SpinQuant"}


def spec_bench_calibration(folder: Path) -> Path:
    """Spec-Bench's non-MT-bench prompts (translation, summarization, QA, math reasoning, RAG) as a text jsonl."""
    path = folder / "spec_bench_calibration.jsonl"
    with open(DATA / "spec_bench" / "question.jsonl") as source, open(path, "w") as target:
        for line in source:
            record = json.loads(line)
            if record["category"] not in MT_BENCH:
                target.write(json.dumps({"text": "\n\n".join(record["turns"])}) + "\n")
    return path


# Linux counts the memory a child was forked with in its peak RSS, so a child of this (model-holding) process
# would report at least our own size: start each command from a small fresh wrapper and read its children's usage
WRAPPER = (
    "import json, resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "usage = resource.getrusage(resource.RUSAGE_CHILDREN); print(json.dumps([usage.ru_utime + usage.ru_stime, usage.ru_maxrss]))"
)


def run_measured(command: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MiB) of one command."""
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", WRAPPER, *command], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    cpu, peak_kib = json.loads(run.stdout.strip().splitlines()[-1])
    return seconds, cpu, peak_kib / 1024


def llmc_quantize(folder: Path, name: str, body: str, model: str, calibration: Path, samples: int, seq_len: int):
    """llmc on the calibration windows, or without a calibration section where the recipe needs no data (RTN with
    dynamic or no input quantization: the section would only measure each layer's error, at the cost of the passes)."""
    from llmc.pipeline.recipe import load_recipe

    slug = name.lower().replace(" ", "-").replace("+", "-")
    recipe = folder / f"{slug}.yaml"
    section = f"calibration:\n  dataset: {calibration}\n  num_samples: {samples}\n  seq_len: {seq_len}\n"
    if (folder / slug / "config.json").is_file():  # kept by an earlier --keep run
        return folder / slug, None, None, None
    recipe.write_text(f"model: {model}\noutput: {folder / slug}\n{section}{body}")
    if not load_recipe(recipe).needs_calibration:
        recipe.write_text(f"model: {model}\noutput: {folder / slug}\n{body}")
    return (folder / slug, *run_measured([sys.executable, "-m", "llmc", "quantize", str(recipe)]))


def layerwise_seconds(artifact: Path) -> float | None:
    """llmc's own timing of the layer-by-layer work (calibration passes, stages, writing), without process start,
    imports and evals."""
    manifest = artifact / "llmc.json"
    return json.loads(manifest.read_text())["timings"]["quantize_s"] if manifest.is_file() else None


def llmcompressor_worker(folder: str, method: str, symmetric: bool, ids_file: str, output: str) -> None:
    """Runs in its own process (imports nothing of llmc, so it can run in llm-compressor's own venv): llm-compressor on
    the same token windows of the model folder, saved as compressed-tensors."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # llm-compressor 0.14's AWQ pins its activation cache, which raises without an accelerator; on CPU pinning
    # would only speed up host-to-device copies that never happen
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    ids = load_file(ids_file)["input_ids"]
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * ids.shape[0]})
    scheme = {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 64,
        "actorder": "static" if method == "gptq-static" else None}}}
    if method.startswith(("preset-", "gptq-preset-")):  # the preset as it is (int ones at group 64), by RTN or GPTQ
        modifier = GPTQModifier if method.startswith("gptq-") else QuantizationModifier
        preset = method.split("preset-", 1)[1]
        if preset.startswith("W"):
            from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

            scheme_of = preset_name_to_scheme(preset, ["Linear"])
            scheme_of.weights.group_size = 64
            recipe = [modifier(ignore=["lm_head"], config_groups={"group_0": scheme_of})]
        else:
            recipe = [modifier(targets="Linear", ignore=["lm_head"], scheme=preset)]
    elif method.startswith("spinquant-preset-"):  # R1 and R2 fused into the weights, then the preset by RTN
        from llmcompressor.modifiers.transform import SpinQuantModifier

        preset = method.removeprefix("spinquant-preset-")
        # random Hadamard as llmc's: its deterministic one exists only for powers of two, and SmolLM2's width is 576
        rotation = SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard")
        if preset.startswith("W"):
            from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

            scheme_of = preset_name_to_scheme(preset, ["Linear"])
            if scheme_of.weights.group_size:
                scheme_of.weights.group_size = 64
            recipe = [rotation, QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": scheme_of})]
        else:
            recipe = [rotation, QuantizationModifier(targets="Linear", ignore=["lm_head"], scheme=preset)]
    elif method == "kv-nvfp4":  # the KV cache alone, in the NVFP4 preset's activation format
        from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

        recipe = [QuantizationModifier(kv_cache_scheme=preset_name_to_scheme("NVFP4", ["Linear"]).input_activations)]
    elif method == "awq":
        recipe = [AWQModifier(ignore=["lm_head"], config_groups=scheme)]
    elif method in ("w8a8", "smoothquant-w8a8", "fp8-dynamic"):
        smoothing = [SmoothQuantModifier(smoothing_strength=0.8)] if method == "smoothquant-w8a8" else []
        preset = "FP8_DYNAMIC" if method == "fp8-dynamic" else "W8A8"
        recipe = smoothing + [QuantizationModifier(targets="Linear", ignore=["lm_head"], scheme=preset)]
    else:
        recipe = [GPTQModifier(ignore=["lm_head"], config_groups=scheme, actorder="static" if method == "gptq-static" else None)]
    oneshot(model=loaded, dataset=dataset, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=ids.shape[0])
    # W4A8 / W4AFP8 packed, as vLLM reads them and llm-compressor's docs save W4AFP8
    packed = method.endswith(("preset-W4A8", "preset-W4AFP8"))
    loaded.save_pretrained(output, save_compressed=True, **({"quantization_format": "pack-quantized"} if packed else {}))
    AutoTokenizer.from_pretrained(folder).save_pretrained(output)


def autoround_worker(folder: str, preset: str, steps: str, ids_file: str, output: str) -> None:
    """Runs in auto-round's own venv: auto-round 0.16 on the same token windows, the preset at group 64, symmetric,
    `steps` iterations a block with its other defaults (batch 8, lr 1 / iters, best step kept), exported in
    llm-compressor's format (compressed-tensors)."""
    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = load_file(ids_file)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rounding = AutoRound(model, tokenizer, bits=int(preset[1]), group_size=64, sym=True, iters=int(steps),
                         nsamples=ids.shape[0], seqlen=ids.shape[1], batch_size=8, dataset=[row[None] for row in ids],
                         device_map="cpu")
    staging = Path(output).with_name(Path(output).name + ".staging")
    rounding.quantize_and_save(str(staging), format="llm_compressor")
    (written,) = [config.parent for config in staging.glob("*/config.json")]  # it writes into a folder named by model and scheme
    written.rename(output)
    staging.rmdir()


def llmcompressor_quantize(folder: Path, name: str, model: str, ids_file: Path, methods: dict, python: str,
                           autoround_python: str, steps: int):
    from llmc.checkpoints.spec import resolve_model

    method, symmetric = methods[name]
    output = folder / name.replace(" ", "-")
    if (output / "config.json").is_file():  # kept by an earlier --keep run
        return output, None, None, None
    command = [python, __file__, "--worker", str(resolve_model(model)), method, str(symmetric), str(ids_file), str(output)]
    if method.startswith("autoround-"):
        command = [autoround_python, __file__, "--autoround-worker", str(resolve_model(model)), method.removeprefix("autoround-"),
                   str(steps), str(ids_file), str(output)]
    return (output, *run_measured(command))


def perplexity_of(target: str, text: str, windows: int) -> float:
    from llmc.evals.loading import load_model
    from llmc.evals.perplexity import perplexity

    loaded = load_model(target)
    return perplexity(loaded.model, loaded.tokenizer, text, "wikitext2", 1024, windows, label=target[-40:]).perplexity


def business_comparison(model: str, artifacts: dict[str, Path], dataset: Path, limit: int | None) -> dict[str, dict]:
    """Per artifact: recovery, agreement and KL against the base model on the business set (`llmc eval`'s side by
    side, every model through transformers on its dequantized weights)."""
    from llmc.evals.config import BusinessEval, EvalConfig
    from llmc.evals.suite import EvalTarget, evaluate_side_by_side

    targets = [EvalTarget("base", model)] + [EvalTarget(name, str(path)) for name, path in artifacts.items()]
    report = evaluate_side_by_side(targets, EvalConfig(business=BusinessEval(dataset=str(dataset), limit=limit)))
    return {name: report["targets"][name]["vs_baseline"] for name in artifacts}


def quality_table(args) -> list[dict]:
    import importlib.util

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from llmc.calib.data import CalibrationConfig, load_calibration
    from llmc.checkpoints.spec import resolve_model

    text = (DATA / "wikitext-2-raw" / "wiki.test.raw").read_text()
    base = args.fp32_perplexity or perplexity_of(args.model, text, args.windows)
    rows = [{"method": "fp32", "perplexity": base, "seconds": None, "cpu": None, "rss": None, "layerwise": None}]
    print(json.dumps(rows[0]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        calibration = spec_bench_calibration(folder)
        config = CalibrationConfig(dataset=str(calibration), num_samples=args.samples, seq_len=args.seq_len)
        ids = load_calibration(config, AutoTokenizer.from_pretrained(resolve_model(args.model))).input_ids
        save_file({"input_ids": ids.contiguous()}, str(folder / "ids.safetensors"))
        ours, theirs = SUITES[args.suite]
        runs = {name: partial(llmc_quantize, folder, name, body.replace("STEPS", str(args.autoround_steps)), args.model,
                              calibration, args.samples, args.seq_len)
                for name, body in ours.items()}
        if args.llmcompressor_python or args.autoround_python or importlib.util.find_spec("llmcompressor"):
            python = args.llmcompressor_python or sys.executable
            runs |= {name: partial(llmcompressor_quantize, folder, name, args.model, folder / "ids.safetensors", theirs, python,
                                   args.autoround_python or sys.executable, args.autoround_steps)
                     for name in theirs}
        for name in args.only or runs:
            if name not in runs:
                print(f"{name}: llmcompressor is not installed", file=sys.stderr)
                continue
            try:
                artifact, seconds, cpu, rss = runs[name]()
            except RuntimeError as error:  # one method failing (e.g. an llm-compressor version quirk) keeps the rest
                print(f"{name}: {error}", file=sys.stderr)
                continue
            rows.append({"method": name, "perplexity": perplexity_of(str(artifact), text, args.windows),
                         "seconds": seconds, "cpu": cpu, "rss": rss, "layerwise": layerwise_seconds(artifact),
                         "artifact": artifact})
            print(json.dumps(rows[-1], default=str), flush=True)
        if args.business:
            compared = business_comparison(args.model, {row["method"]: row["artifact"] for row in rows[1:]}, args.business,
                                           args.business_limit)
            for row in rows[1:]:
                row["business"] = compared[row["method"]]
                print(json.dumps({"method": row["method"], **row["business"]}), flush=True)
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        folder, method, symmetric, ids_file, output = sys.argv[2:]
        return llmcompressor_worker(folder, method, symmetric == "True", ids_file, output)
    if sys.argv[1:2] == ["--autoround-worker"]:
        return autoround_worker(*sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", choices=SUITES, default="w4a16")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--fp32-perplexity", type=float, help="the base model's, measured earlier with these windows")
    parser.add_argument("--llmcompressor-python", help="a python with llm-compressor installed, to run its side in")
    parser.add_argument("--autoround-python", help="a python with auto-round installed, to run its side in")
    parser.add_argument("--autoround-steps", type=int, default=200, help="AutoRound's steps per layer, both tools")
    parser.add_argument("--business", type=Path, help="also each artifact's recovery, agreement and KL against the base "
                                                      "on this business set (e.g. calib_data/business/customer_service.jsonl)")
    parser.add_argument("--business-limit", type=int, help="its first N items")
    parser.add_argument("--keep", type=Path, help="write the artifacts into this folder and keep them; an artifact "
                                                  "already there is reused (no quantize timing for it)")
    every = [name for ours, theirs in SUITES.values() for name in [*ours, *theirs]]
    parser.add_argument("--only", nargs="*", choices=every, help="these methods (of the suite), in this order")
    args = parser.parse_args()
    rows = quality_table(args)
    base = rows[0]["perplexity"]
    print(f"\n{TITLES[args.suite]}, calibration {args.samples} x {args.seq_len} Spec-Bench tokens, WikiText-2 {args.windows} x 1024")
    business = ["recovery", "agreement", "kl"] if args.business else []
    print("| method | perplexity | vs fp32 | " + "".join(f"business {key} | " for key in business)
          + "quantize wall s | quantize CPU s | layer-by-layer s | peak RSS MiB |")
    print("|---|---|---|" + "---|" * (len(business) + 4))
    for row in rows:
        cells = ["" if row.get("business", {}).get(key) is None else f"{row['business'][key]:.3f}" for key in business]
        cells += ["" if row[key] is None else f"{row[key]:.0f}" for key in ("seconds", "cpu", "layerwise", "rss")]
        print(f"| {row['method']} | {row['perplexity']:.3f} | {row['perplexity'] / base - 1:+.2%} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
