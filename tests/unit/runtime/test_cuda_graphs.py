"""Decode through DecodeGraphs: the static buffers, padding rows and scratch KV slot are checked on CPU by replaying
each "graph" as an eager forward over the same buffers; on CUDA, captured graphs must give eager's tokens."""
import pytest
import torch
from helpers import CORPUS, staggered_requests

from llmc.runtime.engine import model_runner
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = [" ".join(CORPUS.split()[start : start + length]) for start, length in ((0, 5), (13, 9), (29, 3))]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)


class EagerReplays(DecodeGraphs):
    """Every "replay" reruns the forward into the output buffer, as a graph writes into its captured output."""

    @staticmethod
    def supported(device: str) -> bool:
        return True

    @staticmethod
    def _capture(forward, pool):
        output = forward()
        return lambda: output.copy_(forward()), output, pool


def staggered(llm: LLM) -> tuple[list[list[int]], torch.Tensor]:
    """One request joins every 4 steps: decode batches of 1, 2 and 3 sequences (the last padded to 4). The tokens,
    and their log-probabilities, which show any difference in the hidden states (a tiny random model's tokens
    may not)."""
    seqs = staggered_requests(llm, PROMPTS, GREEDY, every=4)
    return [seq.output_token_ids for seq in seqs], torch.tensor([token.logprob for seq in seqs for token in seq.logprobs])


def test_graph_batch_sizes():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64] and graph_batch_sizes(3) == [1, 2, 4]


def test_replays_over_static_buffers_give_eager_tokens(tiny_llama, monkeypatch):
    config = EngineConfig(dtype=torch.float32, max_num_seqs=4, num_kv_blocks=24)
    eager = staggered(LLM(str(tiny_llama), config))
    monkeypatch.setattr(model_runner, "DecodeGraphs", EagerReplays)
    llm = LLM(str(tiny_llama), config)
    assert isinstance(llm.runner.graphs, EagerReplays) and llm.runner.kv_cache.shape[2] == 24 + 1  # the scratch block
    replayed_sizes = []
    replay = llm.runner.graphs.replay
    monkeypatch.setattr(llm.runner.graphs, "replay", lambda *args: replayed_sizes.append(args[0].shape[0]) or replay(*args))
    tokens, logprobs = staggered(llm)
    assert tokens == eager[0]
    torch.testing.assert_close(logprobs, eager[1], atol=1e-5, rtol=1e-5)
    assert {1, 2, 3} <= set(replayed_sizes)
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_equals_eager(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = PROMPTS + ["Quantization maps real numbers"]  # four: the graph for 4 runs without padding rows, same GEMMs
    results = []
    for enforce_eager in (True, False):
        llm = LLM(str(tiny_llama), EngineConfig(dtype=torch.float16, device="cuda", max_num_seqs=4, enforce_eager=enforce_eager))
        assert (llm.runner.graphs is None) == enforce_eager
        results.append([output["token_ids"] for output in llm.generate(prompts, params)])
    assert results[0] == results[1]
