import itertools
import time
from enum import Enum, auto

import torch

from llmc.core.integers import cdiv
from llmc.runtime.engine.draft_tree import DraftTree
from llmc.runtime.layers.sampler import SampledToken
from llmc.runtime.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    counter = itertools.count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int, request_id: str | None = None):
        self.seq_id = next(Sequence.counter)
        self.request_id = request_id or str(self.seq_id)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.num_scheduled_tokens = 0  # tokens computed in the current step
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_released_blocks = 0  # leading block table entries out of every layer's window, given back
        self.released_prefix_hash: int | None = None  # the prefix-cache hash of the last of them
        self.draft = DraftTree()  # proposed continuations, verified (and mostly replaced) by the next step
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.grammar = None  # an xgrammar matcher over the output so far, when params.structured_output constrains it
        self.logprobs: list[SampledToken] = []
        # with params.prompt_logprobs: each prompt token's under the tokens before it (none for the first)
        self.prompt_logprobs: list[SampledToken | None] = [None]
        self.hidden_states: list[torch.Tensor] = []  # with EngineConfig.keep_hidden_states: one chunk a step, in order
        self.aux_hidden_states: list[torch.Tensor] = []  # and with EngineConfig.aux_hidden_layers: their chunks
        self.text = ""  # the decoded output, cut at a stop string
        self.num_emitted_chars = 0  # how much of text has been streamed out
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_blocks(self) -> int:
        return cdiv(len(self.token_ids), self.block_size)

    def block(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)
