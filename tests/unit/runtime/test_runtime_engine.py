import pytest
import torch
from helpers import CORPUS, run_staggered, write_recipe

from llmc.core.errors import LlmcError
from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers.cpu_attention import CPP_ATTENTION, compiled_kernel
from llmc.runtime.layers.linear import Int4CpuLinear
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

WORDS = CORPUS.split()
PROMPTS = [" ".join(WORDS[start : start + length]) for start, length in zip(range(0, 80, 10), [3, 9, 5, 14, 7, 2, 11, 6])]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
SCHEMES = {
    "llama-w4-sym-g32": ("tiny_llama", "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"),
    "qwen2-w4-asym-g16": ("tiny_qwen2", "  - type: rtn\n    scheme: W4A16_ASYM\n    weights: {group_size: 16}\n"),
}


@pytest.fixture(scope="module", params=list(SCHEMES))
def artifact(request, tmp_path_factory):
    model_fixture, stage = SCHEMES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    recipe = write_recipe(folder / "recipe.yaml", request.getfixturevalue(model_fixture), folder / "artifact", stage)
    return run_quantize(load_recipe(recipe))


@pytest.fixture(scope="module")
def reference(artifact) -> list[list[int]]:
    """transformers generate, one prompt at a time, on the artifact's dequantized weights."""
    loaded = load_model(str(artifact))
    loaded.model.generation_config.eos_token_id = None  # as ignore_eos: always 64 tokens
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            generated = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def engine(artifact, **overrides) -> LLM:
    return LLM(str(artifact), EngineConfig(dtype=torch.float32, **overrides))


def assert_no_blocks_in_use(llm: LLM):
    assert llm.block_manager.num_used_blocks == 0 and not llm.sequences and not llm.has_unfinished()


@pytest.mark.parametrize("cpu_decode_kernel", [True, False], ids=["cpp-decode", "reference-decode"])
def test_greedy_equals_transformers_with_staggered_arrivals(artifact, reference, cpu_decode_kernel):
    if cpu_decode_kernel and compiled_kernel() is None:
        pytest.skip("no C++ toolchain: the engine decodes on the reference")
    llm = engine(artifact, cpu_decode_kernel=cpu_decode_kernel)
    assert (llm.runner.attention is CPP_ATTENTION) == cpu_decode_kernel
    assert run_staggered(llm, PROMPTS, GREEDY) == reference
    assert_no_blocks_in_use(llm)


@pytest.mark.slow
def test_compiled_layers_give_transformers_tokens(artifact, reference):
    """Chunked prefills, decodes of 1 to 8 rows and preemption all run through the compiled pieces."""
    llm = engine(artifact, compile=True, num_kv_blocks=12, max_num_batched_tokens=8)
    assert run_staggered(llm, PROMPTS, GREEDY, every=1) == reference
    assert llm.scheduler.num_preemptions > 0
    assert llm.runner.compile_s is not None


def test_compile_is_refused_off_the_cpu(artifact):
    with pytest.raises(LlmcError, match="compile runs on the CPU"):
        engine(artifact, compile=True, device="cuda")


def test_prefix_caching_on_and_off_give_the_same_tokens(artifact):
    shared = " ".join(WORDS[:60])
    prompts = [f"{shared} {prompt}" for prompt in PROMPTS]
    cached, uncached = engine(artifact), engine(artifact, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with_cache = run_staggered(cached, prompts, params, every=8)
    assert cached.block_manager.num_prefix_hit_tokens >= 7 * 48
    assert with_cache == run_staggered(uncached, prompts, params, every=8)
    assert uncached.block_manager.num_prefix_hit_tokens == 0


def test_preemption_and_chunked_prefill_under_a_tiny_kv_budget(artifact, reference):
    llm = engine(artifact, num_kv_blocks=12, max_num_batched_tokens=8)
    assert run_staggered(llm, PROMPTS, GREEDY, every=1) == reference
    assert llm.scheduler.num_preemptions > 0
    assert_no_blocks_in_use(llm)


def test_kept_hidden_states_are_transformers_final_features_through_chunks_and_preemption(artifact):
    llm = engine(artifact, num_kv_blocks=12, max_num_batched_tokens=8, enable_prefix_caching=False, keep_hidden_states=True)
    seqs = [llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for prompt in PROMPTS]
    while llm.has_unfinished():
        llm.step()
    assert llm.scheduler.num_preemptions > 0
    loaded = load_model(str(artifact))
    for seq in seqs:
        with torch.no_grad():
            expected = loaded.model.model(torch.tensor([seq.token_ids])).last_hidden_state[0, :-1]
        kept = torch.cat(seq.hidden_states)  # every token but the last sampled one, computed once each
        assert kept.shape == expected.shape
        torch.testing.assert_close(kept, expected, rtol=1e-4, atol=1e-4)


def test_hidden_states_are_kept_only_where_each_token_is_computed_once(artifact):
    with pytest.raises(LlmcError, match="no prefix caching, no drafts"):
        engine(artifact, keep_hidden_states=True)


def test_bfloat16_engine_runs_the_int4_kernel(artifact):
    llm = LLM(str(artifact), EngineConfig(dtype=torch.bfloat16))
    kernels = {type(module) for module in llm.runner.model.modules()}
    assert (Int4CpuLinear in kernels) == ("-sym-" in artifact.parent.name)
    outputs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(output["token_ids"]) for output in outputs] == [8, 8, 8]


@pytest.fixture(scope="module")
def llm(artifact) -> LLM:
    return engine(artifact)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0]["token_ids"]
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [SamplingParams(temperature=1.0, max_tokens=30), params, GREEDY])
    assert mixed[1]["token_ids"] == alone
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.9, seed=8, max_tokens=24, ignore_eos=True))[0]
    assert other_seed["token_ids"] != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm, reference):
    for params in (SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True),
                   SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16, ignore_eos=True)):
        assert [out["token_ids"] for out in llm.generate(PROMPTS[:3], params)] == [tokens[:16] for tokens in reference[:3]]


def test_stop_strings_and_stop_token_ids(llm, reference):
    full = llm.generate([PROMPTS[0]], GREEDY)[0]
    stop = full["text"][20:23]
    stopped = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop=[stop]))[0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == full["text"][: full["text"].find(stop)]
    stop_id = reference[0][5]
    by_id = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert by_id["token_ids"] == reference[0][: reference[0].index(stop_id) + 1] and by_id["finish_reason"] == "stop"
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]["finish_reason"] == "length"


def test_logprobs_are_the_model_distribution(llm, artifact):
    loaded = load_model(str(artifact))
    ids = loaded.tokenizer.encode(PROMPTS[3], add_special_tokens=False)
    with torch.no_grad():
        expected = loaded.model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    first = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=3, logprobs=5))[0]["logprobs"][0]
    assert first.token_id == int(expected.argmax()) and max(first.top_logprobs.values()) == first.logprob
    assert list(first.top_logprobs) == expected.topk(5).indices.tolist()
    assert first.logprob == pytest.approx(float(expected.max()), abs=1e-4)


def test_prompt_logprobs_are_transformers_through_chunks_preemption_and_a_warm_prefix_cache(artifact):
    llm = engine(artifact, num_kv_blocks=12, max_num_batched_tokens=8)
    llm.generate(PROMPTS[3:4], GREEDY)  # its prompt's blocks are cached: prompt logprobs must not skip them
    lengths = [0, 64] * 4
    outputs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=3) for n in lengths])
    assert llm.scheduler.num_preemptions > 0
    assert [len(output["token_ids"]) for output in outputs] == lengths
    loaded = load_model(str(artifact))
    for prompt, output in zip(PROMPTS, outputs):
        ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            expected = loaded.model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        entries = output["prompt_logprobs"]
        assert entries[0] is None and [entry.token_id for entry in entries[1:]] == ids[1:]
        torch.testing.assert_close(torch.tensor([entry.logprob for entry in entries[1:]]), expected[torch.arange(len(ids) - 1), ids[1:]],
                                   rtol=1e-4, atol=1e-4)
        assert [list(entry.top_logprobs) for entry in entries[1:]] == expected.topk(3).indices.tolist()
    assert_no_blocks_in_use(llm)


def test_abort_frees_blocks_and_bad_requests_are_clear_errors(llm):
    seq = llm.add_request(PROMPTS[1], GREEDY)
    llm.step()
    assert llm.block_manager.num_used_blocks > 0
    llm.abort(seq.request_id)
    assert seq.finish_reason == "abort"
    assert_no_blocks_in_use(llm)
    with pytest.raises(LlmcError, match="prompt has 600 tokens"):
        llm.add_request([1] * 600, GREEDY)
    with pytest.raises(LlmcError, match="top_p"):
        SamplingParams(top_p=0)


VARIANTS = {
    "mistral": ("mistral", {}),
    "llama-linear-rope-tied": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                         "tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                                  "rope_theta": 10000.0}}),
    "qwen2-biases": ("qwen2", {}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_checkpoints_of_each_family_match_transformers(tmp_path, variant):
    from helpers import build_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = VARIANTS[variant]
    tokenizer = build_tokenizer(tmp_path)
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id, **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            parameter.data.normal_(0, 0.5)  # transformers starts Qwen2's q/k/v biases at zero
    model.save_pretrained(tmp_path)
    model.generation_config.eos_token_id = None
    llm = engine(tmp_path, num_kv_blocks=32)
    outputs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, output in zip(PROMPTS[:4], outputs):
        ids = torch.tensor([llm.tokenize(prompt)])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert output["token_ids"] == generated[0, ids.shape[1] :].tolist()
