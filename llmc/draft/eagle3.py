"""EAGLE-3 training on self-distilled answers: whole sequences (prompt and answer, `draft.sequences`) drafted `unroll`
steps deep as serving drafts, each step against the target's distribution, learned on the answer's tokens only.
Whole sequences, as EAGLE-3 trains, let the draft attend to the prompt as it does when serving, and so learn to copy
from a passage the request carries. The draft's LM head starts from the target's rows of the draft vocabulary, its
final norm from the target's."""
from pathlib import Path

import torch
from transformers import AutoConfig

from llmc.draft.config import DraftConfig
from llmc.draft.data import DistillSet
from llmc.draft.features import FeatureSource
from llmc.draft.losses import eagle3_loss, unrolled
from llmc.draft.sequences import SequenceBatch, padded_batch, sequence_rows
from llmc.draft.train import TrainConfig, train
from llmc.draft.vocabulary import draft_vocabulary
from llmc.draft.windows import WindowSampler, held_out_windows, window_length
from llmc.runtime.models.loader import WeightLoader
from llmc.runtime.speculative.eagle3 import Eagle3Draft, eagle3_config


def train_eagle3(data: DistillSet, features: FeatureSource, config: DraftConfig, aux_layers: list[int], folder: Path,
                 artifact: Path, device: torch.device | str = "cpu") -> tuple[Eagle3Draft, dict]:
    """The trained draft and its training summary (the train-draft summary's fields); features: where the sequences'
    target features come from (stored with data or computed online)."""
    weights = WeightLoader(artifact, torch.float32, "cpu")
    embeddings = weights.tensor("model.embed_tokens.weight")
    unroll = config.unroll
    window_len = window_length(data.token_ids, unroll)
    seqs = [(torch.tensor(ids), index, start) for index, (ids, start) in enumerate(zip(data.token_ids, data.answer_starts))]
    training, held_out = held_out_windows(seqs, window_len + unroll + 1)
    vocab, to_vocab = draft_vocabulary([ids[start:] for ids, _, start in training], len(data.lm_head))
    lm_head = data.lm_head[vocab].to(device)
    torch.manual_seed(config.seed)  # the draft's initial weights
    draft = Eagle3Draft(eagle3_config(AutoConfig.from_pretrained(artifact), aux_layers, len(vocab)))
    draft.set_vocab(vocab)
    with torch.no_grad():
        draft.lm_head.weight.copy_(data.lm_head[vocab])
        draft.norm.weight.copy_(weights.tensor("model.norm.weight"))
    sampler = WindowSampler(window_len, unroll, max(1, config.batch_size // window_len), torch.Generator().manual_seed(config.seed))

    def batch(pool: list) -> SequenceBatch:
        """sampler.num_windows whole sequences' padded_batch, on device."""
        picks = sampler.pick(pool)
        read = features([index for _, index, _ in picks])
        sequences = [sequence_rows(ids, answer_start, hidden, aux, embeddings, to_vocab, unroll)
                     for (ids, _, answer_start), (hidden, aux) in zip(picks, read)]
        return padded_batch(sequences).to(device)

    def loss_fn(step: int) -> torch.Tensor:
        return eagle3_loss(draft, batch(training), lm_head, unroll)

    def guesses(pool: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        drawn = batch(pool)
        steps = unrolled(draft, draft.combine(drawn.aux), drawn.embedded, drawn.positions, unroll, drawn.deep_rows)
        return [(draft.logits(predicted).argmax(-1), drawn.step_labels(step)) for step, predicted in enumerate(steps)]

    losses = train(draft, loss_fn, TrainConfig(steps=config.steps, lr=config.lr, seed=config.seed), folder, "eagle-3 draft", device)
    summary = {"train": sampler.train_summary(config.steps, config.lr, losses, guesses, training, held_out), "num_held_out": len(held_out)}
    return draft.cpu(), summary
