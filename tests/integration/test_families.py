"""Each dense family on a tiny random config built from transformers' own config class: quantized by llmc, loaded
by transformers as it is, folded by AWQ and SmoothQuant without changing the full-precision layer, and served by
llmc's runtime with transformers' greedy tokens (continuous batching, prefix caching, chunked prefill)."""
import json

import pytest
import torch
from helpers import CORPUS, FAMILY_CONFIGS, build_tiny_model, run_staggered, write_recipe
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from llmc.calib.driver import build_skeleton, decoder_layers, embed, layer_linears, materialize
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.checkpoints.families import family_for
from llmc.core.errors import LlmcError
from llmc.core.prompts import distinct_prompts
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.quant.awq import AWQRun, AWQStage
from llmc.quant.layer import LayerRunner, LayerWork, recording
from llmc.quant.qtypes import QuantArgs, fake_quantize
from llmc.quant.smoothquant import SmoothQuantRun, SmoothQuantStage
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

W4_G16 = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 16}\n"
WORDS = CORPUS.split()
PROMPTS = [" ".join(WORDS[start : start + length]) for start, length in zip(range(0, 40, 10), [3, 9, 5, 14])]
MAX_TOKENS = 32


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family_model(request, tmp_path_factory):
    overrides = dict(FAMILY_CONFIGS[request.param])
    num_layers = overrides.pop("num_layers", 2)
    folder = tmp_path_factory.mktemp(request.param)
    return build_tiny_model(folder, request.param, num_layers=num_layers, seed=3, **overrides)


@pytest.fixture(scope="module")
def artifact(family_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("artifact")
    return run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", family_model, folder / "w4a16", W4_G16)))


def eager_reference(folder):
    """transformers' model in eager attention: the one that applies every family's soft caps and windows."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def reference_tokens(artifact) -> list[list[int]]:
    """transformers' generate, one prompt at a time, on the artifact's dequantized weights, in eager attention."""
    loaded = load_model(str(artifact))
    model = loaded.model
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def test_runtime_greedy_equals_transformers(artifact, reference_tokens):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    assert run_staggered(llm, PROMPTS, greedy) == reference_tokens
    # the same prompts again: their prefixes come from the cache, in chunks of 8 tokens
    chunked = LLM(str(artifact), EngineConfig(dtype=torch.float32, max_num_batched_tokens=8))
    assert run_staggered(chunked, PROMPTS + PROMPTS, greedy) == reference_tokens + reference_tokens
    assert chunked.block_manager.num_prefix_hit_tokens > 0


def test_transformers_loads_the_artifact_as_llmc_fake_quantizes_it(family_model, artifact):
    reference = eager_reference(family_model)
    linears = [name for name, module in reference.named_modules() if isinstance(module, torch.nn.Linear) and name != "lm_head"]
    for name in linears:
        linear = reference.get_submodule(name)
        linear.weight.data = fake_quantize(linear.weight.data, QuantArgs(num_bits=4, group_size=16))
    served = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, reference.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def first_layer(folder):
    config = AutoConfig.from_pretrained(folder)
    family = family_for(config)
    skeleton = build_skeleton(config)
    layer = decoder_layers(skeleton, family)[0]
    reader = CheckpointReader(folder)
    materialize(layer, reader, f"{family.layers}.0")
    input_ids = torch.randint(0, config.vocab_size, (6, 16), generator=torch.Generator().manual_seed(2))
    hidden = embed(reader, family, input_ids)
    hidden[..., [5, 17, 42]] *= 20  # a few channels with large activations, as in real LLMs
    runner = LayerRunner(skeleton, config, seq_len=16, batch_size=3)
    runner.select(0)
    return family, layer, hidden, runner


@pytest.mark.parametrize("transform", ["awq", "smoothquant"])
def test_scaling_pairs_fold_without_changing_the_full_precision_layer(family_model, transform):
    family, layer, hidden, runner = first_layer(family_model)
    before = runner(layer, hidden)
    linears = layer_linears(layer, "model.layers.0")
    if transform == "awq":
        stage = AWQRun(AWQStage(type="awq"), torch.float32, family)
    else:
        stage = SmoothQuantRun(SmoothQuantStage(type="smoothquant"), torch.float32, family)
    work = LayerWork(layer, "model.layers.0", linears, {name: QuantArgs(num_bits=4, group_size=16) for name in linears}, runner)
    observed = stage.observed_modules(work)
    assert observed  # the family's pairs are found in the layer
    norms_before = {name: module.weight.detach().clone() for name, module in layer.named_modules() if name.endswith("layernorm")}
    with recording(observed, stage.record):
        runner(layer, hidden)
    stage.process(work)
    changed = [name for name, weight in norms_before.items() if not torch.equal(layer.get_submodule(name).weight, weight)]
    assert changed  # something was scaled
    torch.testing.assert_close(runner(layer, hidden), before, rtol=1e-4, atol=1e-4)


def test_an_unsupported_family_is_refused_at_the_start(tmp_path):
    folder = build_tiny_model(tmp_path / "model", "gpt_neox")
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", folder, tmp_path / "out", W4_G16))
    with pytest.raises(LlmcError, match="gpt_neox.*supported: llama.*gemma2.*phi3"):
        run_quantize(recipe)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def windowed_artifact(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral-window")
    model = build_tiny_model(folder / "model", "mistral", seed=5, sliding_window=16)
    return run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", model, folder / "w4a16", W4_G16)))


def test_blocks_out_of_every_layers_window_are_given_back(windowed_artifact):
    """A long Mistral generation holds no more blocks than its window needs, and still decodes transformers' tokens."""
    loaded = load_model(str(windowed_artifact))
    loaded.model.set_attn_implementation("eager")
    prompt_ids = loaded.tokenizer.encode(PROMPTS[3], add_special_tokens=False)
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        expected = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False,
                                         eos_token_id=None)[0, len(prompt_ids) :].tolist()
    block_size = 4
    llm = LLM(str(windowed_artifact), EngineConfig(dtype=torch.float32, block_size=block_size))
    seq = llm.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    most_held = 0
    while llm.has_unfinished():
        llm.step()
        most_held = max(most_held, len(seq.block_table) - seq.num_released_blocks) if seq.block_table else most_held
    assert seq.output_token_ids == expected
    assert most_held <= 16 // block_size + 2  # the window, the block being written, one of slack for the step's tokens
    assert len(prompt_ids) + 120 > 4 * 16  # without the release it would have held far more
    assert llm.block_manager.num_used_blocks == 0


def test_prefix_caching_with_windows_gives_the_uncached_tokens(windowed_artifact):
    shared = " ".join(WORDS[:40])  # longer than the window: its first blocks are given back before the next request
    prompts = [f"{shared} {prompt}" for prompt in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cached = LLM(str(windowed_artifact), EngineConfig(dtype=torch.float32, block_size=4))
    uncached = LLM(str(windowed_artifact), EngineConfig(dtype=torch.float32, block_size=4, enable_prefix_caching=False))
    with_cache = [cached.generate([prompt], params)[0]["token_ids"] for prompt in prompts]
    assert cached.block_manager.num_prefix_hit_tokens >= 3 * 32
    assert with_cache == [output["token_ids"] for output in uncached.generate(prompts, params)]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "method", "features"), [
    ("gemma2", "medusa", "stored"), ("gemma2", "eagle", "stored"), ("gemma2", "eagle3", "stored"),
    ("gemma3_text", "eagle3", "stored"), ("qwen3", "eagle3", "online"),
])
def test_draft_heads_train_on_the_family_and_speculation_keeps_its_greedy_tokens(tmp_path, calib_file, monkeypatch, family, method,
                                                                                 features):
    """Gemma 2 sets the most options apart from Llama (scaled embeddings, soft caps, windows), Gemma 3 its RoPE by layer
    type, Qwen3 a head size apart from hidden / heads: drafts are trained on the quantized model through the runtime
    (EAGLE-3 on the aux layers' features, stored by the distillation or, for Qwen3, computed online) and speculative
    decoding still writes its greedy tokens."""
    monkeypatch.setenv("LLMC_HOME", str(tmp_path / "home"))
    overrides = dict(FAMILY_CONFIGS[family])
    model = build_tiny_model(tmp_path / "model", family, seed=3, **overrides)
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", W4_G16, calib_file)
    recipe.write_text(recipe.read_text() + f"draft:\n  method: {method}\n  prompts: [{calib_file}]\n"
                      "  num_prompts: 4\n  max_tokens: 24\n  num_heads: 2\n  steps: 20\n  batch_size: 32\n"
                      + (f"  features: {features}\n" if method == "eagle3" else ""))
    artifact = run_quantize(load_recipe(recipe, ["calibration.num_samples=2"]))
    assert (artifact / "draft" / "heads.safetensors").is_file()
    assert json.loads((artifact / "draft" / "config.json").read_text())["train"].get("features", "stored") == features
    stored = [path for path in (tmp_path / "home" / "distill").glob("*.safetensors") if "hidden" in load_file(path)]
    assert len(stored) == (features == "stored")  # online: the answers' token ids alone
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_engine = LLM(str(artifact), EngineConfig(dtype=torch.float32))
    # the training prompts: a draft that learned the answers it was trained on must find them again where it serves,
    # which a mismatch between training and serving (features, embeddings, positions) would break
    prompts = PROMPTS + distinct_prompts(calib_file, 4, plain_engine.tokenizer)
    plain = plain_engine.generate(prompts, greedy)
    drafting = LLM(str(artifact), EngineConfig(dtype=torch.float32, speculative=artifact / "draft", speculative_min_confidence=0.0,
                                                       speculative_max_num_seqs=len(prompts), adaptive_speculation=False))
    assert [output["token_ids"] for output in drafting.generate(prompts, greedy)] == [output["token_ids"] for output in plain]
    stats = drafting.runner.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens / stats.num_drafts > 0.05  # a guess among 400 tokens: ~0.01
