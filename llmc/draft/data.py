"""Self-distillation: the quantized target answers the training prompts with the runtime engine (greedy, as it
will be served), then reads each prompt + answer once more to give the hidden states the heads learn from."""
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from llmc.errors import LlmcError
from llmc.runtime.bench import load_prompts
from llmc.runtime.config import EngineConfig
from llmc.runtime.engine import LLMEngine
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence


@dataclass(slots=True)
class DistillSet:
    token_ids: list[list[int]]  # prompt + the target's own answer
    hidden: list[torch.Tensor]  # [len - 1, hidden] float32 final hidden states, one per token but the last
    answer_starts: list[int]  # index of the first answer token
    lm_head: torch.Tensor  # [vocab, hidden] float32, the target's output projection as served

    @property
    def num_answer_tokens(self) -> int:
        return sum(len(ids) - start for ids, start in zip(self.token_ids, self.answer_starts))


def check_not_eval_set(path: Path) -> None:
    first = next((line for line in path.read_text().splitlines() if line.strip()), "{}") if path.is_file() else "{}"
    row = json.loads(first)
    if "question_id" in row and "turns" in row:
        raise LlmcError(f"{path} looks like MT-bench, the evaluation set; train draft heads on other prompts")


def self_distill(artifact: Path, prompts_file: Path, num_prompts: int, max_tokens: int, max_len: int = 1024) -> DistillSet:
    check_not_eval_set(prompts_file)
    engine = LLMEngine(artifact, EngineConfig(enable_prefix_caching=False, max_model_len=max_len))
    prompts = list(dict.fromkeys(load_prompts(prompts_file, num_prompts, engine.tokenizer, chat_template=True, shared_prefix_tokens=0)))
    prompts = [prompt for prompt in prompts if len(engine.tokenize(prompt)) + max_tokens < engine.max_model_len]
    if not prompts:
        raise LlmcError(f"no prompt of {prompts_file} fits {engine.max_model_len} tokens with a {max_tokens}-token answer")
    seqs = [engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)) for prompt in prompts]
    with tqdm(total=len(seqs), desc="target answers its prompts", unit="answer") as progress:
        while engine.has_unfinished():
            progress.update(sum(output.finish_reason is not None for output in engine.step()))
    hidden_size = engine.runner.hf_config.hidden_size
    lm_head = engine.runner.model.compute_logits(torch.eye(hidden_size, dtype=engine.config.dtype)).T.float()
    data = DistillSet([], [], [], lm_head)
    for answered in tqdm(seqs, desc="target hidden states", unit="answer"):
        seq = Sequence(answered.token_ids, SamplingParams(), engine.config.block_size)
        engine.block_manager.allocate(seq)
        seq.num_scheduled_tokens = len(seq)
        data.hidden.append(engine.runner.forward([seq])[:-1].float())
        engine.block_manager.free(seq)
        data.token_ids.append(seq.token_ids)
        data.answer_starts.append(answered.num_prompt_tokens)
    return data
