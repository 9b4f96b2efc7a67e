"""The fused C++ decoder stack (layers/cpu_decode_stack.py, models/decode_stack.py) against the eager layers it
replaces: the same hidden states bit for bit at every row count, each row's bits independent of the
rows beside it, the same greedy tokens under staggered arrivals, and the refusals (float32, FP8 KV cache, 8-bit
Linears, experts) that keep the layer-by-layer path."""
import pytest
import torch
from helpers import CORPUS, build_tiny_model, run_staggered, write_recipe

from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers import cpu_nibble_gemv
from llmc.runtime.layers.attention import AttentionMetadata
from llmc.runtime.llm import LLM
from llmc.runtime.models.decode_stack import refusal
from llmc.runtime.sampling_params import SamplingParams

WORDS = CORPUS.split()
PROMPTS = [" ".join(WORDS[start : start + length]) for start, length in zip(range(0, 60, 10), [3, 9, 5, 14, 7, 2])]
W4A16 = "  - type: rtn\n    scheme: W4A16\n    weights: {group_size: 32}\n"
# llama (tied off), qwen2 (QKV biases), qwen3 (q/k norms), phi3 (partial rotary, fused QKV)
FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 16}, "phi3": {"pad_token_id": 0}}


@pytest.fixture(autouse=True)
def needs_the_kernel():
    if not cpu_nibble_gemv.available():
        pytest.skip("the CPU has no AVX-512 BF16: decode steps run layer by layer")


@pytest.fixture(scope="module", params=list(FAMILIES))
def artifact(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"stack-{request.param}")
    model = build_tiny_model(folder / "model", request.param, hidden=128, **FAMILIES[request.param])
    return run_quantize(load_recipe(write_recipe(folder / "recipe.yaml", model, folder / "artifact", W4A16)))


def decode_metadata(llm: LLM, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """rows sequences of `length` cached positions (random K/V already in the cache) each decoding one token."""
    block_size = llm.runner.block_size
    blocks = -(-(length + 1) // block_size)
    tables = torch.arange(rows * blocks).reshape(rows, blocks)
    positions = torch.full((rows,), length)
    slots = tables[:, length // block_size] * block_size + length % block_size
    metadata = AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=torch.full((rows,), length + 1),
                                 seq_lens=[length + 1] * rows, query_lens=[1] * rows, num_decodes=rows)
    return torch.randint(0, 200, (rows,)), positions, metadata


def one_row(metadata: AttentionMetadata, row: int) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=metadata.slot_mapping[row : row + 1], block_tables=metadata.block_tables[row : row + 1],
                             context_lens=metadata.context_lens[row : row + 1], seq_lens=metadata.seq_lens[row : row + 1],
                             query_lens=[1], num_decodes=1)


def test_a_step_equals_the_eager_layers_and_each_row_gets_its_own_bits(artifact):
    llm = LLM(str(artifact), EngineConfig())
    stack, model = llm.runner.decode_stack, llm.runner.model
    assert stack is not None
    torch.manual_seed(0)
    llm.runner.kv_cache.normal_()
    with torch.inference_mode():
        for rows in (1, 3, 5):
            ids, positions, metadata = decode_metadata(llm, rows, 37)
            fused = stack(model.embed(ids), positions, metadata)
            eager = model(ids, positions, metadata)  # the final norm's output
            assert torch.equal(model.norm(fused), eager)  # bit for bit: speculative verification runs the eager layers
            alone = [stack(model.embed(ids[row : row + 1]), positions[row : row + 1], one_row(metadata, row)) for row in range(rows)]
            assert torch.equal(torch.cat(alone), fused)


def test_greedy_tokens_equal_the_layer_by_layer_engine_with_staggered_arrivals(artifact):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fused = LLM(str(artifact), EngineConfig())
    calls = []
    forward = fused.runner.decode_stack.stack.forward
    fused.runner.decode_stack.stack = type("Counting", (), {"forward": lambda self, *args: calls.append(1) or forward(*args)})()
    eager = LLM(str(artifact), EngineConfig(cpu_decode_stack=False))
    assert eager.runner.decode_stack is None
    assert run_staggered(fused, PROMPTS, greedy) == run_staggered(eager, PROMPTS, greedy)
    assert calls  # the stack served the decode steps


def test_what_keeps_the_layer_by_layer_path(artifact, tmp_path):
    assert LLM(str(artifact), EngineConfig(dtype=torch.float32)).runner.decode_stack is None
    assert LLM(str(artifact), EngineConfig(max_eager_int4_rows=2)).runner.decode_stack.max_rows == 2
    model = LLM(str(artifact), EngineConfig()).runner.model
    assert refusal(model, torch.float8_e4m3fn, torch.bfloat16) == "it runs bfloat16 with a bfloat16 KV cache"
    w8 = build_tiny_model(tmp_path / "model", hidden=128)
    recipe = write_recipe(tmp_path / "recipe.yaml", w8, tmp_path / "w8", "  - type: rtn\n    scheme: W8A16\n")
    int8 = LLM(str(run_quantize(load_recipe(recipe))), EngineConfig()).runner.model
    assert refusal(int8, torch.bfloat16, torch.bfloat16) == "a Linear is not 4-bit on the nibble kernel"
