"""Calibration samples: documents from a local file or a hub dataset, rendered (optionally through the chat
template), shuffled with a seed, concatenated and cut into num_samples windows of seq_len tokens."""
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from llmc.checkpoints.hub import require_hub
from llmc.core.errors import LlmcError
from llmc.core.schema import StrictModel

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class CalibrationConfig(StrictModel):
    dataset: str = "calib_data/smollm2_self_generated.jsonl"
    split: str = "train"
    text_field: str = "text"
    messages_field: str = "messages"
    chat_template: bool = False
    num_samples: int = Field(64, gt=0)
    seq_len: int = Field(512, gt=0)
    seed: int = 0
    # precision of the calibration forward passes; weights, statistics and algorithms stay float32
    dtype: Literal["float32", "bfloat16"] = "float32"


@dataclass
class CalibrationSet:
    input_ids: torch.Tensor  # [num_samples, seq_len]
    source: str
    compute_dtype: torch.dtype = torch.float32  # of the calibration forward passes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.input_ids.to(torch.int64).numpy().tobytes()).hexdigest()


def load_documents(dataset: str, split: str = "train"):
    import datasets

    datasets.disable_progress_bars()
    path = Path(dataset)
    if path.suffix in LOCAL_BUILDERS:
        if not path.is_file():
            raise LlmcError(f"calibration file not found: {path}")
        return datasets.load_dataset(LOCAL_BUILDERS[path.suffix], data_files=str(path), split="train")
    require_hub(f"calibration dataset {dataset!r}", "pass a local .jsonl, .json, .txt or .parquet file instead")
    try:
        return datasets.load_dataset(dataset, split=split)
    except Exception as error:  # offline, unknown name, gated: all surface as the hub client's own types
        raise LlmcError(f"could not load dataset {dataset!r} (split {split!r}): {error}") from None


def render(record: dict, config: CalibrationConfig, tokenizer) -> str:
    if config.chat_template and config.messages_field in record:
        return tokenizer.apply_chat_template(record[config.messages_field], tokenize=False)
    if config.text_field not in record:
        wanted = f"{config.text_field!r}" + (f" or {config.messages_field!r}" if config.chat_template else "")
        raise LlmcError(f"calibration data {config.dataset}: records have no field {wanted} (fields: {sorted(record)})")
    return record[config.text_field]


def load_calibration(config: CalibrationConfig, tokenizer) -> CalibrationSet:
    documents = list(load_documents(config.dataset, config.split))
    random.Random(config.seed).shuffle(documents)
    needed = config.num_samples * config.seq_len
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokens: list[int] = []
    for record in documents:
        text = render(record, config, tokenizer)
        if text.strip():
            tokens += tokenizer(text, add_special_tokens=False)["input_ids"] + separator
        if len(tokens) >= needed:
            break
    if len(tokens) < needed:
        raise LlmcError(
            f"calibration data {config.dataset} has {len(tokens)} tokens, fewer than num_samples x seq_len = "
            f"{config.num_samples} x {config.seq_len}; lower one of them or add data"
        )
    input_ids = torch.tensor(tokens[:needed]).reshape(config.num_samples, config.seq_len)
    return CalibrationSet(input_ids, config.dataset, getattr(torch, config.dtype))
