"""`llmc train-draft`: self-distil the artifact's model, train draft heads on it, and store them in ARTIFACT/draft."""
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoConfig

from llmc.artifact.writer import MANIFEST, write_manifest
from llmc.draft.data import DistillSet, cached_self_distill
from llmc.draft.eagle import OUT_OF_VOCAB, EagleDraft, EagleShape
from llmc.draft.medusa import MedusaHeads, medusa_labels
from llmc.draft.store import DRAFT_DIR, save_draft, save_heads
from llmc.draft.train import TrainConfig, train
from llmc.errors import LlmcError
from llmc.recipe import DraftConfig
from llmc.runtime.loader import WeightLoader

EAGLE_WINDOW = 128  # tokens per training window (fewer when the answers are shorter)
DRAFT_VOCAB_SIZE = 8192  # the draft guesses among the answers' most frequent tokens: its LM head costs a sixth of the target's


def train_draft(artifact: Path, config: DraftConfig) -> Path:
    if not (artifact / MANIFEST).is_file():
        raise LlmcError(f"{artifact} is not an llmc artifact (no {MANIFEST})")
    started = time.perf_counter()
    data = DistillSet.joined([cached_self_distill(artifact, Path(file), config.num_prompts, config.max_tokens) for file in config.prompts])
    distill_s = time.perf_counter() - started
    folder = artifact / DRAFT_DIR
    if config.method == "eagle":
        summary = train_eagle(data, config, folder, artifact)
    else:
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


def eagle_shape(artifact: Path, draft_vocab_size: int) -> EagleShape:
    """The draft layer takes the target's own layer sizes."""
    hf = AutoConfig.from_pretrained(artifact)
    rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or getattr(hf, "rope_theta", 10000.0)
    return EagleShape(hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size, rope_theta,
                      hf.rms_norm_eps, draft_vocab_size)


def most_frequent_tokens(answers: list[torch.Tensor], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` token ids the answers use most (fewer when they use fewer), in id order."""
    counts = torch.bincount(torch.cat(answers), minlength=vocab_size)
    used = int((counts > 0).sum())
    return counts.argsort(descending=True, stable=True)[: min(size, used)].sort().values


def train_eagle(data: DistillSet, config: DraftConfig, folder: Path, artifact: Path) -> dict:
    """Windows of (feature at t, token t + 1) pairs; the draft learns the feature at t + 1 and the token t + 2 it
    leads to. Only answer tokens are learned, with the cross-entropy over the draft's vocabulary (the answers' most
    frequent tokens: a rarer one is learned through its feature alone)."""
    embeddings = WeightLoader(artifact, torch.float32, "cpu").tensor("model.embed_tokens.weight")
    unroll = config.unroll
    window_len = min(EAGLE_WINDOW, max(len(ids) for ids in data.token_ids) - unroll - 1)
    seqs = [(torch.tensor(ids), hidden, start) for ids, hidden, start in zip(data.token_ids, data.hidden, data.answer_starts)
            if len(ids) >= window_len + unroll + 1 and start + 1 < len(ids)]
    vocab = most_frequent_tokens([ids[start:] for ids, _, start in seqs], len(data.lm_head), DRAFT_VOCAB_SIZE)
    to_vocab = torch.full((len(data.lm_head),), OUT_OF_VOCAB, dtype=torch.long)
    to_vocab[vocab] = torch.arange(len(vocab))
    lm_head = data.lm_head[vocab]
    noise_scale = torch.cat([hidden for _, hidden, _ in seqs]).pow(2).mean().sqrt().item()
    shape = eagle_shape(artifact, len(vocab))
    draft = EagleDraft(shape)
    draft.vocab.copy_(vocab)
    generator = torch.Generator().manual_seed(config.seed)
    num_windows = max(1, config.batch_size // window_len)

    def window(ids: torch.Tensor, hidden: torch.Tensor, answer_start: int) -> tuple[torch.Tensor, ...]:
        """Pairs start..end - 1, and the unroll - 1 features and tokens past them that the deeper steps need."""
        first = max(0, min(answer_start - 2 - window_len // 4, len(ids) - window_len - unroll - 1))
        start = int(torch.randint(first, len(ids) - window_len - unroll, (), generator=generator))
        end = start + window_len
        after = torch.arange(start + 2, end + unroll + 1)
        labels = torch.where(after >= answer_start, to_vocab[ids[start + 2 : end + unroll + 1]], -100)
        return hidden[start : end + unroll], embeddings[ids[start + 1 : end + unroll]], torch.arange(start, end), labels

    def batch() -> list[torch.Tensor]:
        picks = torch.randint(len(seqs), (num_windows,), generator=generator).tolist()
        return [torch.stack(parts) for parts in zip(*(window(*seqs[index]) for index in picks))]

    def loss_fn(step: int) -> torch.Tensor:
        return draft.loss(*batch(), lm_head, noise_scale, unroll)

    train_config = TrainConfig(steps=config.steps, lr=config.lr, seed=config.seed)
    losses = train(draft, loss_fn, train_config, folder, "eagle draft")
    with torch.no_grad():
        features, embedded, positions, labels = batch()
        steps = draft.unrolled(features[:, :window_len], embedded, positions, unroll)
        top1 = []
        for step, predicted in enumerate(steps):
            step_labels = labels[:, step : step + window_len]
            valid = step_labels != -100
            top1.append(((predicted @ lm_head.T).argmax(-1) == step_labels)[valid].float().mean().item())
    summary = {
        "method": "eagle", "hidden_size": shape.hidden_size, "shape": asdict(shape),
        "trained_on": {"prompts": config.prompts, "num_answers": len(data.token_ids), "answer_tokens": data.num_answer_tokens},
        "train": {"steps": config.steps, "batch_size": num_windows * window_len, "lr": config.lr, "final_loss": losses[-1],
                  "unroll": unroll, "train_top1_per_step": [round(value, 4) for value in top1]},
    }
    save_heads(folder, draft)
    save_draft(folder, summary)
    return summary
