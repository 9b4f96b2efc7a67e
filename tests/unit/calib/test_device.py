"""The device a recipe computes on: resolved before any work, recorded in the manifest with the peak memory; where
CUDA exists, the stages' results on it match the CPU's."""
import json

import pytest
import torch
from click.testing import CliRunner
from helpers import write_recipe
from safetensors.torch import load_file

from llmc.artifact.writer import MANIFEST
from llmc.cli import cli
from llmc.core.device import resolve_device
from llmc.core.errors import LlmcError
from llmc.draft.build import train_draft
from llmc.draft.config import DraftConfig
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe

STAGES = {
    "gptq": "  - type: gptq\n    scheme: W4A16\n    weights: {group_size: 32}\n",
    "awq-rtn": "  - type: awq\n  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n",
    "smoothquant-w8a8-static": "  - type: smoothquant\n  - type: rtn\n    scheme: W8A8\n"
                               "    input_activations: {strategy: tensor, dynamic: false}\n",
    "fp8-kv": "  - type: rtn\n    scheme: FP8_DYNAMIC\nkv_cache: {dtype: fp8}\n",
    "rotate-autoround": "  - type: rotate\n  - type: autoround\n    scheme: W4A16\n    weights: {group_size: 32}\n"
                        "    steps: 5\n    batch_size: 8\n",
}
# signed gradient steps of 1/5 each: a gradient near zero whose sign the device's rounding flips moves an offset by a
# fifth of a code, and a few codes cross a rounding boundary
EQUAL_CODES = {"rotate-autoround": 0.98}


def quantize(tmp_path, model, calib_file, stage: str, device: str):
    recipe = write_recipe(tmp_path / f"{device}.yaml", model, tmp_path / device.replace(":", "-"), stage, calib_file)
    recipe.write_text(recipe.read_text().replace("stages:\n", f"device: {device}\nstages:\n"))
    return run_quantize(load_recipe(recipe))


def tensors(artifact) -> dict[str, torch.Tensor]:
    return {name: tensor for shard in sorted(artifact.glob("*.safetensors")) for name, tensor in load_file(shard).items()}


def test_auto_is_cuda_when_there_is_one_else_cpu_and_bad_names_are_refused():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(LlmcError, match="expected auto, cpu, cuda or cuda:N, got 'gpu'"):
        resolve_device("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_cuda_without_cuda_is_one_error_naming_the_line_before_any_work(tmp_path, tiny_llama, calib_file):
    with pytest.raises(LlmcError) as error:
        quantize(tmp_path, tiny_llama, calib_file, STAGES["gptq"], "cuda")
    assert str(error.value).startswith("cuda.yaml line 7: device: cuda asked for, but")
    assert "use cpu (or auto)" in str(error.value)
    assert not (tmp_path / "cuda").exists() and not list(tmp_path.glob(".cuda.partial-*"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
@pytest.mark.parametrize("command", [["train-draft", "missing-artifact"], ["eval", "missing-model", "--perplexity", "none"]])
def test_device_option_is_resolved_before_any_work(command):
    run = CliRunner().invoke(cli, [*command, "--device", "cuda:1"])
    assert run.exit_code == 1 and str(run.exception).startswith("--device: cuda:1 asked for, but"), run.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_draft_heads_distil_and_train_on_cuda(tmp_path, tiny_llama, calib_file, monkeypatch, method):
    """EAGLE-3 on a GPU reads the target's features online by default: the engine's prefill on CUDA every step."""
    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))
    artifact = quantize(tmp_path, tiny_llama, calib_file, STAGES["gptq"], "cuda")
    config = DraftConfig(method=method, prompts=[str(calib_file)], num_prompts=6, max_tokens=24, num_heads=2, steps=40,
                         batch_size=32)
    folder = train_draft(artifact, config, "cuda")
    summary = json.loads((folder / "config.json").read_text())
    assert summary["train"]["device"] == "cuda"
    assert summary["train"].get("features", "stored") == ("online" if method == "eagle3" else "stored")
    heads = load_file(folder / "heads.safetensors")
    assert all(tensor.device.type == "cpu" and tensor.isfinite().all() for tensor in heads.values())
    losses = summary["train"]["final_loss"]
    assert losses < 10


def test_the_manifest_records_the_device_and_peak_memory(tmp_path, tiny_llama, calib_file):
    artifact = quantize(tmp_path, tiny_llama, calib_file, STAGES["gptq"], "cpu")
    manifest = json.loads((artifact / MANIFEST).read_text())
    assert manifest["device"] == "cpu" and manifest["memory"]["peak_device_gib"] is None
    assert 0.1 < manifest["memory"]["peak_host_rss_gib"] < 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to compare against the CPU")
@pytest.mark.parametrize("stage", list(STAGES))
def test_every_stage_on_cuda_matches_the_cpu(tmp_path, tiny_llama, calib_file, stage):
    on_cpu, on_cuda = (tensors(quantize(tmp_path, tiny_llama, calib_file, STAGES[stage], device)) for device in ("cpu", "cuda"))
    assert on_cpu.keys() == on_cuda.keys()
    for name, tensor in on_cpu.items():
        if tensor.dtype in (torch.int32, torch.int8, torch.float8_e4m3fn):  # packed or unpacked codes
            assert (tensor.view(torch.uint8) == on_cuda[name].view(torch.uint8)).float().mean() >= EQUAL_CODES.get(stage, 0.999), name
        else:
            torch.testing.assert_close(tensor.float(), on_cuda[name].float(), rtol=1e-3, atol=1e-4)


def test_the_preflight_refuses_a_run_that_cannot_fit_naming_what_to_lower(tmp_path, tiny_llama, calib_file, monkeypatch):
    import llmc.calib.memory
    import llmc.pipeline.quantize

    monkeypatch.setattr(llmc.calib.memory, "available_host_bytes", lambda: 2**20)
    monkeypatch.setattr(llmc.pipeline.quantize, "quantize_layerwise", lambda *args: pytest.fail("weights were read"))
    with pytest.raises(LlmcError, match=r"memory estimate: host .* needs more than the 0.0 GiB of host memory available; "
                                        r"the largest part is .*: lower"):
        quantize(tmp_path, tiny_llama, calib_file, STAGES["gptq"], "cpu")
    assert not (tmp_path / "cpu").exists()


def test_the_estimate_grows_with_the_calibration_set_and_gptq_solves_the_widest_input():
    from transformers import LlamaConfig

    from llmc.calib.memory import estimate_memory

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    small, large = (estimate_memory(config, ["gptq"], samples, 2048, torch.device("cpu")) for samples in (16, 128))
    assert large.host_gib > small.host_gib and large.parts_gib["activations"] == 8 * small.parts_gib["activations"]
    assert small.parts_gib["statistics"] > 7 * 14336**2 * 4 / 2**30  # the down projection's Hessian, solved
    autoround = estimate_memory(config, ["autoround"], 16, 2048, torch.device("cpu"))
    assert autoround.parts_gib["statistics"] > 3 * 16 * 2048 * 4096 * 4 / 2**30  # inputs, full-precision stream, targets
    rtn = estimate_memory(config, ["rtn"], 16, 2048, torch.device("cpu"))
    assert rtn.parts_gib["statistics"] == 0 and rtn.device_gib is None
