"""Mixture-of-experts families (Mixtral, Qwen3-MoE): the calibration block that unfuses transformers' experts into
the checkpoint's per-expert Linears, the stages over it, the artifact, and the runtime's MoE block, each against
transformers."""
import json
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, build_tiny_model, first_layer, run_staggered, write_recipe
from transformers import AutoConfig, AutoModelForCausalLM

from llmc.calib.driver import decoder_linears, layer_linears
from llmc.calib.memory import LayerShapes
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import family_for
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.awq import AWQStage, scalable_pairs
from llmc.quant.gptq import GPTQStage
from llmc.quant.layer import LayerRunner, LayerWork, recording
from llmc.quant.qtypes import QuantArgs, fake_quantize
from llmc.quant.smoothquant import SmoothQuantStage
from llmc.quant.stage import start_stage
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers.linear import Int4CpuLinear
from llmc.runtime.layers.moe import SparseMoeBlock, moe_block
from llmc.runtime.llm import LLM
from llmc.runtime.models.loader import WeightLoader
from llmc.runtime.sampling_params import SamplingParams

PREFIX = "model.layers.0"
NUM_EXPERTS = 4
# model type, layers, config fields; Qwen3-MoE's layer 1 keeps a dense MLP
MODELS = {
    "mixtral": ("mixtral", 2, {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", 3, {"num_experts": NUM_EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                   "mlp_only_layers": [1], "norm_topk_prob": True}),
    "qwen3_moe-unnormalized": ("qwen3_moe", 2, {"num_experts": NUM_EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                "norm_topk_prob": False}),
}
STAGES = {
    "rtn": "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n",
    "gptq": "  - type: gptq\n    scheme: W4A16\n    weights: {group_size: 32}\n",
    "awq": "  - type: awq\n  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n",
}
W4_G32 = QuantArgs(num_bits=4, strategy="group", group_size=32)
W8 = QuantArgs(num_bits=8, strategy="channel")
WORDS = CORPUS.split()
# long enough for a full 16-token KV block each, which the prefix cache keeps
PROMPTS = [" ".join(WORDS[start : start + length]) for start, length in zip(range(0, 40, 10), [18, 25, 21, 30])]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """name -> the tiny float32 checkpoint, built on first use."""
    built: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in built:
            model_type, num_layers, fields = MODELS[name]
            built[name] = build_tiny_model(tmp_path_factory.mktemp(name), model_type, num_layers=num_layers, **fields)
        return built[name]

    return folder


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, model_folder, calib_file):
    """(model, stage) -> its quantized artifact, made on first use."""
    made: dict[tuple[str, str], Path] = {}

    def quantized(name: str, stage: str) -> Path:
        if (name, stage) not in made:
            folder = tmp_path_factory.mktemp(f"{name}-{stage}")
            calibration = calib_file if stage != "rtn" else None
            recipe = write_recipe(folder / "recipe.yaml", model_folder(name), folder / "artifact", STAGES[stage], calibration)
            made[name, stage] = run_quantize(load_recipe(recipe))
        return made[name, stage]

    return quantized


def transformers_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def spread_inputs(tokens: int = 48, hidden: int = 64) -> torch.Tensor:
    return 3 * torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))


def assert_routes_vary(router: torch.nn.Module, inputs: torch.Tensor) -> None:
    """The test's tokens reach every expert (the router is not degenerate)."""
    chosen = router(inputs.reshape(-1, inputs.shape[-1])).topk(2, dim=-1).indices
    assert set(chosen.flatten().tolist()) == set(range(NUM_EXPERTS))


@pytest.mark.parametrize("name", list(MODELS))
def test_calibration_block_is_transformers_block_with_the_checkpoint_names(model_folder, name):
    folder = model_folder(name)
    setup = first_layer(folder, num_samples=1, seq_len=8, seed=0)
    family = family_for(setup.config)
    block = setup.layer.get_submodule(family.moe.block)
    assert setup.layer.mlp is block and [child for child, _ in setup.layer.named_children()].count(family.moe.block) == 1
    checkpoint = {name.removeprefix(f"{PREFIX}.") for name in CheckpointReader(folder).file_of if name.startswith(f"{PREFIX}.")}
    assert set(setup.layer.state_dict()) == checkpoint  # per-expert 2-D Linears, as saved (materialize loads them strictly)
    inputs = spread_inputs().reshape(2, 24, 64)
    assert_routes_vary(block.gate, inputs)
    with torch.no_grad():
        expected = transformers_model(folder).model.layers[0].mlp(inputs)
        torch.testing.assert_close(block(inputs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_every_expert_sees_every_token_and_gate_up_share_one_hessian(model_folder, name, compute_dtype):
    setup = first_layer(model_folder(name), num_samples=3, seq_len=16, seed=0)
    family = family_for(setup.config)
    layout = family.moe
    runner = LayerRunner(setup.skeleton, setup.config, seq_len=16, batch_size=2, compute_dtype=compute_dtype)
    linears = {name: linear for name, linear in decoder_linears(setup.skeleton, family).items() if name.startswith(f"{PREFIX}.")}
    assert f"{PREFIX}.{layout.router}" not in linears and f"{PREFIX}.{layout.router}" in layer_linears(setup.layer, PREFIX)
    gptq = start_stage(GPTQStage(type="gptq", scheme="W4A16", weights={"group_size": 32}), torch.float32, family)
    work = LayerWork(setup.layer, PREFIX, linears, {name: W4_G32 for name in linears}, runner)
    with recording(gptq.observed_modules(work), gptq.record):
        runner(setup.layer, setup.hidden)
    tokens = 3 * 16
    experts = [f"{PREFIX}.{layout.expert(index)}" for index in range(NUM_EXPERTS)]
    gates_and_ups = [f"{expert}.{linear}" for expert in experts for linear in (layout.gate, layout.up)]
    owner = gptq.owner[gates_and_ups[0]]
    assert {gptq.owner[linear] for linear in gates_and_ups} == {owner} and gptq.counts[owner] == tokens
    assert all(gptq.counts[f"{expert}.{layout.down}"] == tokens for expert in experts)
    assert sorted(gates_and_ups) in [sorted(group) for group in gptq.input_groups(work)]  # one stacked solve
    quantized = gptq.process(work)
    assert set(quantized) == set(linears)


def fold(stage, setup, plan_format: QuantArgs) -> list:
    """The stage's scales folded into the first layer (nothing quantized); the pairs it scaled."""
    family = family_for(setup.config)
    runner = LayerRunner(setup.skeleton, setup.config, seq_len=16, batch_size=2)
    linears = {name: linear for name, linear in decoder_linears(setup.skeleton, family).items() if name.startswith(f"{PREFIX}.")}
    work = LayerWork(setup.layer, PREFIX, linears, {name: plan_format for name in linears}, runner)
    transform = start_stage(stage, torch.float32, family)
    with recording(transform.observed_modules(work), transform.record):
        runner(setup.layer, setup.hidden)
    pairs = scalable_pairs(family, work)
    transform.process(work)
    return pairs


@pytest.mark.parametrize("stage", [AWQStage(type="awq"), SmoothQuantStage(type="smoothquant", alpha=0.5)], ids=["awq", "smoothquant"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_folded_scales_leave_the_full_precision_layer_unchanged(model_folder, name, stage):
    setup = first_layer(model_folder(name), num_samples=4, seq_len=16, seed=0)
    setup.hidden[..., [5, 17, 42]] *= 20  # outlier channels, for scales far from 1
    layout = family_for(setup.config).moe
    runner = LayerRunner(setup.skeleton, setup.config, seq_len=16, batch_size=2)
    before = runner(setup.layer, setup.hidden)
    router = setup.layer.get_submodule(layout.router).weight.detach().clone()
    pairs = fold(stage, setup, W4_G32 if isinstance(stage, AWQStage) else W8)
    into_experts = next(pair for pair in pairs if pair.also_scaled)
    assert into_experts.block == layout.block and len(into_experts.balance) == 2 * NUM_EXPERTS
    assert sum(pair.smooth.endswith(f".{layout.up}") for pair in pairs) == NUM_EXPERTS  # each expert's up -> down
    assert not torch.allclose(setup.layer.get_submodule(layout.router).weight, router)  # the router took the inverse scale
    torch.testing.assert_close(runner(setup.layer, setup.hidden), before, rtol=1e-4, atol=1e-4 * before.abs().max().item())


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_memory_preflight_counts_every_expert(model_folder, name):
    setup = first_layer(model_folder(name), num_samples=1, seq_len=8, seed=0)
    linears = layer_linears(setup.layer, PREFIX).values()
    assert LayerShapes.of(setup.config).layer_params == sum(linear.weight.numel() for linear in linears)


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_artifact_holds_each_expert_quantized_under_the_checkpoint_names_and_the_router_in_full_precision(artifact, name, stage):
    folder = artifact(name, stage)
    tensors = set(CheckpointReader(folder).file_of)
    config = AutoConfig.from_pretrained(folder)
    layout = family_for(config).moe
    sparse = [index for index in range(config.num_hidden_layers) if layout.is_sparse(config, index)]
    for index in sparse:
        layer = f"model.layers.{index}"
        for expert in range(NUM_EXPERTS):
            for linear in (layout.gate, layout.up, layout.down):
                assert f"{layer}.{layout.expert(expert)}.{linear}.weight_packed" in tensors
        assert f"{layer}.{layout.router}.weight" in tensors and f"{layer}.{layout.router}.weight_packed" not in tensors
    dense_layers = set(range(config.num_hidden_layers)) - set(sparse)
    assert all(f"model.layers.{index}.mlp.down_proj.weight_packed" in tensors for index in dense_layers)
    ignored = json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]
    assert sorted(ignored) == sorted(["lm_head", *(f"model.layers.{index}.{layout.router}" for index in sparse)])


def fake_quantized(model: torch.nn.Module, args: QuantArgs) -> torch.nn.Module:
    """Every decoder Linear's weight fake-quantized, each expert's gate, up and down (rows of transformers' fused 3-D
    parameters) as their own; the routers and the LM head left."""
    for module in model.model.layers.modules():  # the routers are not Linears in transformers
        if isinstance(module, torch.nn.Linear):
            module.weight.data = fake_quantize(module.weight.data, args)
        elif hasattr(module, "gate_up_proj"):  # groups run along the input dim, so the experts' rows quantize apart
            for fused in (module.gate_up_proj, module.down_proj):
                fused.data = torch.stack([fake_quantize(expert, args) for expert in fused.data])
    return model


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_transformers_loads_the_artifact_as_llmc_fake_quantizes_it(model_folder, artifact, name):
    """transformers decompresses the per-expert tensors itself (compressed-tensors) and fuses them into its experts;
    llmc's evals load the dequantized weights through transformers' checkpoint conversion to the same logits."""
    folder = artifact(name, "rtn")
    reference = fake_quantized(transformers_model(model_folder(name)), W4_G32)
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(transformers_model(folder)(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_model(str(folder)).model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_evals_emulate_quantized_expert_inputs_as_the_runtime_computes_them(tmp_path, model_folder):
    """W8A8 experts: llmc's evals give each expert its own Linear to fake-quantize its inputs, and agree with the
    runtime's int8 matmuls."""
    stage = "  - type: rtn\n    scheme: W8A8\n"
    folder = run_quantize(load_recipe(write_recipe(tmp_path / "r.yaml", model_folder("mixtral"), tmp_path / "w8a8", stage)))
    loaded = load_model(str(folder)).model
    hooked = [name for name, module in loaded.named_modules() if module._forward_pre_hooks]
    assert "model.layers.0.block_sparse_moe.experts.3.w2" in hooked
    loaded.generation_config.eos_token_id = None
    ids = torch.randint(0, loaded.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[0, 12:].tolist()
    llm = LLM(str(folder), EngineConfig(dtype=torch.float32))
    assert llm.generate([ids[0].tolist()], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]["token_ids"] == expected


def runtime_block(folder: Path, dtype: torch.dtype, layer: int = 0) -> SparseMoeBlock | None:
    config = AutoConfig.from_pretrained(folder)
    return moe_block(config, family_for(config).moe, layer, f"model.layers.{layer}", WeightLoader(folder, dtype, "cpu"))


@pytest.mark.parametrize("name", list(MODELS))
def test_runtime_block_is_transformers_block_on_the_dequantized_weights(artifact, name):
    folder = artifact(name, "rtn")
    block = runtime_block(folder, torch.float32)
    inputs = spread_inputs()
    assert_routes_vary(block.router, inputs)
    with torch.no_grad():
        expected = transformers_model(folder).model.layers[0].mlp(inputs[None])[0]
        torch.testing.assert_close(block(inputs), expected, rtol=1e-5, atol=1e-5)
        weights, experts = block.router(inputs).float().softmax(-1).topk(2, dim=-1)
        if block.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        # the CUDA-graph path (every expert on every token) gives the same output
        torch.testing.assert_close(block.every_expert(inputs, weights, experts), expected, rtol=1e-5, atol=1e-5)


def test_runtime_builds_moe_blocks_only_for_sparse_layers(artifact, tiny_llama):
    folder = artifact("qwen3_moe", "rtn")
    assert [runtime_block(folder, torch.float32, layer) is None for layer in range(3)] == [False, True, False]
    assert runtime_block(tiny_llama, torch.float32) is None


def test_runtime_block_in_bfloat16_runs_the_int4_kernel(artifact):
    folder = artifact("mixtral", "rtn")
    block = runtime_block(folder, torch.bfloat16)
    assert all(isinstance(linear, Int4CpuLinear) for linear in [*block.gate_up, *block.down])
    inputs = spread_inputs()
    with torch.no_grad():
        torch.testing.assert_close(block(inputs.bfloat16()).float(), runtime_block(folder, torch.float32)(inputs), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize(("name", "stage"), [("mixtral", "gptq"), ("qwen3_moe", "awq")])
def test_runtime_greedy_tokens_are_transformers_on_the_artifact(artifact, name, stage, compile):
    """Staggered arrivals, the prompts twice so the second ones start from the prefix cache; compiled, the MoE block's
    grouping runs eagerly between graphs."""
    folder = artifact(name, stage)
    model = transformers_model(folder)
    model.generation_config.eos_token_id = None  # as ignore_eos
    llm = LLM(str(folder), EngineConfig(dtype=torch.float32, enable_prefix_caching=True, compile=compile))
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([llm.tokenize(prompt)])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        expected.append(generated[0, ids.shape[1] :].tolist())
    assert run_staggered(llm, PROMPTS + PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)) == expected + expected
    assert llm.block_manager.num_prefix_hit_tokens >= 4 * 16 and llm.block_manager.num_used_blocks == 0
