"""Data-parallel calibration: `llmc quantize --nproc 2` runs two gloo processes on the CPU, each on half the
samples, and writes the artifact one process writes, up to the order in which float32 statistics are summed (and the
few codes and GPTQ scales that order flips)."""
import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from helpers import write_recipe
from safetensors.torch import load_file

from llmc.artifact.writer import MANIFEST
from llmc.cli import cli
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.ranks import Ranks

STAGES = {
    "gptq-kv": "  - type: gptq\n    scheme: W4A16\n    weights: {group_size: 32}\nkv_cache: {dtype: fp8}\n",
    "awq-clip-rtn": "  - type: awq\n    clip_search: true\n  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n",
    # every step on all samples (each rank's whole share): the summed gradients' signs are one process's
    "autoround": "  - type: autoround\n    scheme: W4A16\n    weights: {group_size: 32}\n    steps: 5\n    batch_size: 8\n",
    "smoothquant-w8a8-static": "  - type: smoothquant\n  - type: gptq\n    scheme: W8A8\n"
                               "    input_activations: {strategy: tensor, dynamic: false}\n",
}
CODES = (torch.int32, torch.int8, torch.float8_e4m3fn)


def test_the_ranks_shares_are_the_samples_in_order():
    shares = [Ranks(rank, 3).samples(10) for rank in range(3)]
    assert [list(range(10))[share] for share in shares] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


def tensors(artifact) -> dict[str, torch.Tensor]:
    return {name: tensor for shard in sorted(artifact.glob("*.safetensors")) for name, tensor in load_file(shard).items()}


def unpacked(codes: torch.Tensor) -> torch.Tensor:
    """Packed int4 codes as their nibbles, the others as bytes."""
    if codes.dtype == torch.int32:
        return torch.stack([(codes >> shift) & 15 for shift in range(0, 32, 4)])
    return codes.view(torch.uint8)


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_two_gloo_processes_write_the_one_process_artifact(tmp_path, tiny_llama, calib_file, stage):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "one", STAGES[stage], calib_file)
    recipe.write_text(recipe.read_text().replace("num_samples: 4", "num_samples: 8"))
    one = run_quantize(load_recipe(recipe))
    run = subprocess.run([sys.executable, "-m", "llmc", "quantize", str(recipe), "--output", str(tmp_path / "two"), "--nproc", "2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    two = tmp_path / "two"
    assert json.loads((two / MANIFEST).read_text())["ranks"] == 2
    expected, got = tensors(one), tensors(two)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        if tensor.dtype in CODES:
            # the first layer sees identical inputs; later ones inputs that carry its flipped codes, and flip more
            share = 0.995 if name.startswith("model.layers.0.") else 0.97
            equal = (unpacked(tensor) == unpacked(got[name])).float().mean()
            assert equal >= share, f"{name}: {float(equal):.4f} of codes equal"
        elif name.endswith(".weight_scale"):
            # a later layer's GPTQ scales follow weights its error feedback moved, from a Hessian summed in another order
            # over inputs that already carry the earlier layers' flipped codes: a few groups land on another scale
            close = torch.isclose(got[name], tensor, rtol=1e-3, atol=1e-5)
            assert close.float().mean() >= 0.95, f"{name}: {int((~close).sum())} of {close.numel()} scales differ"
        else:
            torch.testing.assert_close(got[name], tensor, rtol=1e-3, atol=1e-5, msg=lambda message, name=name: f"{name}: {message}")
    errors = [[layer["output_error"] for layer in json.loads((artifact / MANIFEST).read_text())["layers"]] for artifact in (one, two)]
    assert errors[1] == pytest.approx(errors[0], rel=0.02)


@pytest.mark.parametrize("problem, fields, message", [
    ("no calibration", "  - type: rtn\n    scheme: W4A16\n", "no stage of this recipe uses any: drop --nproc"),
    ("too few samples", STAGES["gptq-kv"], "--nproc 8 shares calibration.num_samples 4 among the ranks"),
])
def test_nproc_is_refused_where_the_ranks_would_fail(tmp_path, tiny_llama, calib_file, problem, fields, message):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", fields, None if problem == "no calibration" else calib_file)
    run = CliRunner().invoke(cli, ["quantize", str(recipe), "--nproc", "8"])
    assert run.exit_code != 0 and message in str(run.exception), run.output
    assert not (tmp_path / "out").exists()
