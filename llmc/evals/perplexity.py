"""Perplexity over non-overlapping windows of the tokenized text (the GPTQ paper's protocol)."""
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from llmc.checkpoints.hub import require_hub
from llmc.core.errors import LlmcError

HUB_TEXTS = {"wikitext2": ("wikitext", "wikitext-2-raw-v1", "test")}


@dataclass
class PerplexityResult:
    dataset: str
    perplexity: float
    tokens: int
    windows: int
    seq_len: int

    def to_dict(self) -> dict:
        return asdict(self)


def load_eval_text(dataset: str) -> str:
    path = Path(dataset).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if dataset not in HUB_TEXTS:
        raise LlmcError(f"perplexity data {dataset!r}: no such file, and not one of {sorted(HUB_TEXTS)}")
    require_hub(f"perplexity data {dataset!r}", "pass a local text file instead (e.g. calib_data/smollm2_eval_text.txt)")
    import datasets

    name, config, split = HUB_TEXTS[dataset]
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # the hub client raises many types when offline
        raise LlmcError(f"could not download {dataset} ({error}); pass a local text file instead") from None
    return "\n\n".join(rows["text"])


@torch.no_grad()
def perplexity(model, tokenizer, text: str, dataset: str, seq_len: int = 1024, max_windows: int | None = 40,
               batch_size: int = 4, label: str = "perplexity") -> PerplexityResult:
    input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    num_windows = input_ids.numel() // seq_len
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows == 0:
        raise LlmcError(f"{dataset}: {input_ids.numel()} tokens, fewer than one window of {seq_len}")
    windows = input_ids[: num_windows * seq_len].reshape(num_windows, seq_len)
    total_nll, total_tokens = 0.0, 0
    for batch in tqdm(windows.split(batch_size), desc=label, unit="batch"):
        batch = batch.to(model.device)
        logits = model(batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += targets.numel()
    return PerplexityResult(dataset, math.exp(total_nll / total_tokens), total_tokens, num_windows, seq_len)
