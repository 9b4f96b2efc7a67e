"""`llmc train-draft`: self-distil the artifact's model, train draft heads on it, and store them in ARTIFACT/draft."""
import json
import time
from pathlib import Path

import torch

from llmc.artifact.writer import MANIFEST, write_manifest
from llmc.draft.data import DistillSet, self_distill
from llmc.draft.medusa import MedusaHeads, medusa_labels
from llmc.draft.store import DRAFT_DIR, save_draft, save_heads
from llmc.draft.train import TrainConfig, train
from llmc.errors import LlmcError
from llmc.recipe import DraftConfig


def train_draft(artifact: Path, config: DraftConfig) -> Path:
    if not (artifact / MANIFEST).is_file():
        raise LlmcError(f"{artifact} is not an llmc artifact (no {MANIFEST})")
    started = time.perf_counter()
    data = self_distill(artifact, Path(config.prompts), config.num_prompts, config.max_tokens)
    distill_s = time.perf_counter() - started
    folder = artifact / DRAFT_DIR
    summary = train_medusa(data, config, folder)
    summary["train"] |= {"distill_s": round(distill_s, 1), "total_s": round(time.perf_counter() - started, 1)}
    save_draft(folder, summary)
    manifest = json.loads((artifact / MANIFEST).read_text())
    write_manifest(artifact, manifest | {"draft": summary})
    return folder


def train_medusa(data: DistillSet, config: DraftConfig, folder: Path) -> dict:
    """Train Medusa heads on self-distilled data into folder; returns the summary that goes in its config.json."""
    hidden = torch.cat([h[start - 1 :] for h, start in zip(data.hidden, data.answer_starts)])
    labels = torch.cat([medusa_labels(ids, start - 1, config.num_heads) for ids, start in zip(data.token_ids, data.answer_starts)])
    heads = MedusaHeads(hidden.shape[1], config.num_heads)
    generator = torch.Generator().manual_seed(config.seed)

    def loss_fn(step: int) -> torch.Tensor:
        rows = torch.randint(len(hidden), (config.batch_size,), generator=generator)
        return heads.loss(hidden[rows], labels[rows], data.lm_head)

    train_config = TrainConfig(steps=config.steps, lr=config.lr, seed=config.seed)
    losses = train(heads, loss_fn, train_config, folder, f"medusa heads ({config.num_heads})")
    with torch.no_grad():
        logits = heads(hidden[-4096:]) @ data.lm_head.T
        valid = labels[-4096:] != -100
        top1 = ((logits.argmax(-1).T == labels[-4096:]) & valid).sum(0) / valid.sum(0)
    summary = {
        "method": "medusa", "num_heads": config.num_heads, "hidden_size": hidden.shape[1],
        "trained_on": {"prompts": config.prompts, "num_answers": len(data.token_ids), "answer_tokens": data.num_answer_tokens},
        "train": {"steps": config.steps, "batch_size": config.batch_size, "lr": config.lr, "final_loss": losses[-1],
                  "train_top1_per_head": [round(value, 4) for value in top1.tolist()]},
    }
    save_heads(folder, heads)
    save_draft(folder, summary)
    return summary
