import json

import pytest
import torch
from helpers import FAMILY_CONFIGS, build_tiny_model, run_staggered, write_recipe
from pydantic import ValidationError
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from llmc.calib.driver import build_skeleton
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import family_for
from llmc.core.errors import LlmcError
from llmc.pipeline.recipe import Recipe
from llmc.quant.hadamard import hadamard_matrix, random_rotation
from llmc.quant.rotate import RotatedCheckpoint, RotationPlan

MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
}
# every family llmc supports; "llama" with tied embeddings, whose LM head the rotation unties
ROTATED_FAMILIES = {"llama": dict(tie_word_embeddings=True), "qwen2": {}, **FAMILY_CONFIGS, **MOE_CONFIGS}
SANDWICH_NORMS = ("gemma2", "gemma3_text")


@pytest.mark.parametrize("order", [2, 12, 20, 28, 36, 64, 576, 1536, 3584, 4096])
def test_hadamard_matrices(order):
    matrix = hadamard_matrix(order)
    assert torch.equal(matrix.abs(), torch.ones_like(matrix))
    assert torch.equal(matrix @ matrix.T, order * torch.eye(order, dtype=torch.float64))


@pytest.mark.parametrize("order", [576, 7])  # 7: no Hadamard matrix; a random orthogonal one
def test_random_rotations_are_orthogonal_and_seeded(order):
    rotation = random_rotation(order, seed=3)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(order, dtype=torch.float64))
    assert torch.equal(rotation, random_rotation(order, seed=3)) and not torch.equal(rotation, random_rotation(order, seed=4))


def rotated_copy(model, folder, rotations):
    """The checkpoint as the rotate stage reads it, written as a checkpoint of its own."""
    config = AutoConfig.from_pretrained(model)
    plan = RotationPlan(config, family_for(config), build_skeleton(config), rotations, seed=0)
    reader = RotatedCheckpoint(CheckpointReader(model), plan)
    folder.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in reader.tensors(list(reader.file_of)).items()},
              folder / "model.safetensors")
    settings = json.loads((model / "config.json").read_text())
    settings["tie_word_embeddings"] = settings.get("tie_word_embeddings", False) and not plan.untie
    (folder / "config.json").write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize("family", list(ROTATED_FAMILIES))
def test_rotations_leave_the_full_precision_logits_unchanged(tmp_path, family):
    overrides = dict(ROTATED_FAMILIES[family])
    model = build_tiny_model(tmp_path / "model", family, num_layers=overrides.pop("num_layers", 2), seed=3, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    for rotations in (["R2"], ["R1", "R2"]):
        if "R1" in rotations and family in SANDWICH_NORMS:
            with pytest.raises(LlmcError, match="R1 cannot be fused into gemma"):
                rotated_copy(model, tmp_path / "r1", rotations)
            continue
        folder = rotated_copy(model, tmp_path / "-".join(rotations), rotations)
        rotated = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        assert not torch.equal(rotated.model.layers[0].self_attn.o_proj.weight, reference.model.layers[0].self_attn.o_proj.weight)
        with torch.no_grad():
            torch.testing.assert_close(rotated(ids).logits, expected, atol=2e-6, rtol=1e-5)


def test_rotate_must_be_the_first_stage(tmp_path):
    stages = [{"type": "smoothquant"}, {"type": "rotate"}, {"type": "rtn", "scheme": "W8A8"}]
    with pytest.raises(ValidationError, match="stages.1 \\(rotate\\) .* must be the first stage"):
        Recipe(model="m", output=str(tmp_path / "o"), stages=stages, calibration={"dataset": "x"})
    with pytest.raises(ValidationError, match="must be followed by a stage that quantizes"):
        Recipe(model="m", output=str(tmp_path / "o"), stages=[{"type": "rotate"}])


def test_rotated_artifact_is_untied_and_served_as_transformers_reads_it(tmp_path):
    from llmc.pipeline.quantize import run_quantize
    from llmc.pipeline.recipe import load_recipe
    from llmc.runtime.engine.config import EngineConfig
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    model = build_tiny_model(tmp_path / "model", tie_word_embeddings=True, seed=5)
    stages = "  - type: rotate\n  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 16}\n"
    artifact = run_quantize(load_recipe(write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", stages)))
    assert json.loads((artifact / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in json.loads((artifact / "model.safetensors.index.json").read_text())["weight_map"]
    served = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32).eval()
    prompt = list(range(3, 15))
    with torch.no_grad():
        expected = served.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None)
    llm = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert run_staggered(llm, [prompt], greedy) == [expected[0, len(prompt):].tolist()]
