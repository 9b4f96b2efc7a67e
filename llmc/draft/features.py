"""Where EAGLE-3 training reads the target's features (final hidden states and the aux layers' residual stream) for
its sequences: stored by the distillation beside the answers, or computed again while training by the engine's
prefill over each sequence (SpecForge's online mode). Stored features take 8 bytes per hidden unit and token on disk
and 10 in memory, which an 8B model's hidden size turns into more than a GPU machine's disk holds
(docs/speculative.md); online, the answers' token ids are all that is kept and every step runs the target over its
sequences: cheap on a GPU, a few times the draft's own step on a CPU. `draft.features: auto` reads them online on a
GPU and stored on a CPU."""
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from transformers import AutoConfig, AutoTokenizer

from llmc.artifact.writer import MANIFEST
from llmc.calib.memory import GIB, available_host_bytes
from llmc.checkpoints.spec import llmc_home
from llmc.core.errors import LlmcError
from llmc.core.prompts import distinct_prompts, read_prompt_texts
from llmc.draft.config import DraftConfig
from llmc.draft.data import DistillSet, distill_cache_path, sequence_features
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1)  # the features come from the prefill; the token is dropped


def feature_mode(config: DraftConfig, device: torch.device) -> Literal["stored", "online"]:
    """Where the draft of this config reads the target's features, training on device."""
    if config.method != "eagle3":
        return "stored"
    if config.features != "auto":
        return config.features
    return "online" if device.type == "cuda" else "stored"


def feature_bytes_per_token(hidden_size: int, num_aux_layers: int) -> tuple[int, int]:
    """(on disk, in memory) per token: its id, the final state in bfloat16 on disk and float32 in memory, aux in
    bfloat16."""
    return 8 + hidden_size * (2 + 2 * num_aux_layers), 8 + hidden_size * (4 + 2 * num_aux_layers)


def stored_feature_bytes(artifact: Path, config: DraftConfig, aux_layers: list[int]) -> tuple[int, int]:
    """(disk, memory) the features of every prompt file take: those cached as stored, those to distil counted from
    their prompts' tokens plus a whole answer each (an upper bound: answers may end sooner). Disk counts the new sets,
    the largest twice: each is written whole beside its parts before they go; for a model not yet quantized, 0: which
    sets the artifact will find cached is not known yet, so only the memory can be checked."""
    hf = AutoConfig.from_pretrained(artifact)
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    disk_per_token, memory_per_token = feature_bytes_per_token(hf.hidden_size, len(aux_layers))
    lm_head = hf.vocab_size * hf.hidden_size * 2  # stored with each set in bfloat16, held once in float32
    is_artifact = (artifact / MANIFEST).is_file()
    new_tokens, cached_tokens = [], 0  # per set to distil; in the sets cached
    for file in map(Path, config.prompts):
        cached = distill_cache_path(artifact, file, config.num_prompts, config.max_tokens, tuple(aux_layers)) if is_artifact else None
        if cached is not None and cached.is_file():
            cached_tokens += (cached.stat().st_size - lm_head) // disk_per_token
            continue
        prompts = distinct_prompts(file, config.num_prompts or len(read_prompt_texts(file)), tokenizer)
        new_tokens.append(sum(len(ids) + config.max_tokens for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]))
    new_sets = [tokens * disk_per_token + lm_head for tokens in new_tokens]
    disk = sum(new_sets) + max(new_sets, default=0) if is_artifact else 0
    return disk, (sum(new_tokens) + cached_tokens) * memory_per_token + 2 * lm_head


def check_stored_features_fit(artifact: Path, config: DraftConfig, aux_layers: list[int]) -> None:
    """Before any distillation: stored features must fit the disk under LLMC_HOME and host memory (before the artifact
    exists, memory alone: stored_feature_bytes)."""
    disk, memory = stored_feature_bytes(artifact, config, aux_layers)
    home = llmc_home()
    disk_free = shutil.disk_usage(next(parent for parent in [home, *home.parents] if parent.exists())).free
    memory_free = available_host_bytes()
    if disk > disk_free or memory > memory_free:
        raise LlmcError(
            f"draft: the target's features for these prompts take {disk / GIB:.1f} GiB of disk while distilled "
            f"({disk_free / GIB:.1f} GiB free under {home}) and {memory / GIB:.1f} GiB of memory in training "
            f"({memory_free / GIB:.1f} GiB available); read them online instead (draft.features: online, the target "
            "runs over each training batch: fast on a GPU) or distil fewer prompts (draft.num_prompts)"
        )


class FeatureSource(Protocol):
    def __call__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per answer index, the final hidden states [>= its tokens - 1, hidden] float32 and aux features [same rows,
        layers * hidden] bfloat16 of its whole sequence."""


@dataclass(slots=True)
class StoredFeatures:
    data: DistillSet  # distilled with its features

    def __call__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.data.hidden[index], self.data.aux[index]) for index in indices]


@dataclass(slots=True)
class OnlineFeatures:
    engine: LLM  # distill_engine with the draft's aux layers
    token_ids: list[list[int]]  # the answers (prompt + answer)

    def __call__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        seqs = [self.engine.add_request(self.token_ids[index], PREFILL_ONLY) for index in indices]
        while self.engine.has_unfinished():
            self.engine.step()
        return list(map(sequence_features, seqs))
