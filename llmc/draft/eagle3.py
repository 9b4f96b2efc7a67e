"""EAGLE-3 training on self-distilled answers: windows of (fused target features at t, token t + 1) pairs, drafted
`unroll` steps deep as serving drafts; step s at row t guesses token t + s + 2 against the target's distribution
there. The draft's LM head starts from the target's rows of the draft vocabulary, its final norm from the target's."""
from pathlib import Path

import torch
from transformers import AutoConfig

from llmc.draft.config import DraftConfig
from llmc.draft.data import DistillSet
from llmc.draft.features import FeatureSource
from llmc.draft.losses import eagle3_loss, unrolled
from llmc.draft.train import TrainConfig, train
from llmc.draft.vocabulary import draft_vocabulary
from llmc.draft.windows import WindowSampler, held_out_windows, window_length
from llmc.runtime.models.loader import WeightLoader
from llmc.runtime.speculative.eagle3 import Eagle3Draft, eagle3_config


def train_eagle3(data: DistillSet, features: FeatureSource, config: DraftConfig, aux_layers: list[int], folder: Path,
                 artifact: Path, device: torch.device | str = "cpu") -> tuple[Eagle3Draft, dict]:
    """The trained draft and its training summary (the train-draft summary's fields); features: where the windows'
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

    def batch(pool: list) -> list[torch.Tensor]:
        """Per window, rows start..end - 1, and the unroll - 1 tokens and target states past them that the deeper
        steps need, stacked on device."""
        picks = sampler.pick(pool)
        spans = [sampler.span(ids, answer_start, to_vocab) for ids, _, answer_start in picks]
        read = features([(index, start + window_len + unroll) for (_, index, _), (start, _) in zip(picks, spans)])
        windows = [
            (aux[start : start + window_len].float(), embeddings[ids[start + 1 : start + window_len + unroll]],
             torch.arange(start, start + window_len), hidden[start + 1 : start + window_len + unroll], labels)
            for (ids, _, _), (start, labels), (hidden, aux) in zip(picks, spans, read)
        ]
        return [torch.stack(parts).to(device) for parts in zip(*windows)]

    def loss_fn(step: int) -> torch.Tensor:
        aux, embedded, positions, target_hidden, labels = batch(training)
        return eagle3_loss(draft, aux, embedded, positions, target_hidden, labels >= 0, lm_head, unroll)

    def guesses(pool: list) -> tuple[list[torch.Tensor], torch.Tensor]:
        aux, embedded, positions, _, labels = batch(pool)
        steps = unrolled(draft, draft.combine(aux), embedded, positions, unroll)
        return [draft.logits(predicted).argmax(-1) for predicted in steps], labels

    losses = train(draft, loss_fn, TrainConfig(steps=config.steps, lr=config.lr, seed=config.seed), folder, "eagle-3 draft", device)
    summary = {"train": sampler.train_summary(config.steps, config.lr, losses, guesses, training, held_out), "num_held_out": len(held_out)}
    return draft.cpu(), summary
