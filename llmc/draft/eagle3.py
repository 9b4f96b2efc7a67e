"""EAGLE-3 training on self-distilled answers: whole sequences (prompt and answer) of (fused target features at t,
token t + 1) pairs, drafted `unroll` steps deep as serving drafts; step s at row t guesses token t + s + 2 against the
target's distribution there, learned on the answer's tokens only. Whole sequences, as EAGLE-3 trains, let the draft
attend to the prompt as it does when serving, and so learn to copy from a passage the request carries. The draft's
LM head starts from the target's rows of the draft vocabulary, its final norm from the target's."""
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig

from llmc.draft.config import DraftConfig
from llmc.draft.data import DistillSet
from llmc.draft.features import FeatureSource
from llmc.draft.labels import NOT_LEARNED
from llmc.draft.losses import eagle3_loss, unrolled
from llmc.draft.train import TrainConfig, train
from llmc.draft.vocabulary import draft_vocabulary
from llmc.draft.windows import WindowSampler, held_out_windows, window_length
from llmc.runtime.models.loader import WeightLoader
from llmc.runtime.speculative.eagle3 import Eagle3Draft, eagle3_config


def sequence_rows(ids: torch.Tensor, answer_start: int, hidden: torch.Tensor, aux: torch.Tensor, embeddings: torch.Tensor,
                  to_vocab: torch.Tensor, unroll: int) -> tuple[torch.Tensor, ...]:
    """One whole sequence's training rows: the aux features of the rows that have unroll tokens after them, then the
    embeddings and target final states of the token after each row and the unroll - 1 past the last, and the
    draft-vocabulary index of the token each (row, step) guesses (row t at step s guesses token t + s + 2;
    NOT_LEARNED before the answer)."""
    labels = torch.where(torch.arange(2, len(ids)) >= answer_start, to_vocab[ids[2:]], NOT_LEARNED)
    return aux[: len(ids) - unroll - 1].float(), embeddings[ids[1:-1]], hidden[1 : len(ids) - 1], labels


def padded_batch(sequences: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """sequence_rows of several sequences stacked as (aux, embeddings, positions, target states, labels), each padded
    at its end: causal attention keeps the padding out of every real row, and its labels learn nothing."""
    *features, labels = zip(*sequences)
    aux, embedded, target_hidden = (pad_sequence(list(group), batch_first=True) for group in features)
    labels = pad_sequence(list(labels), batch_first=True, padding_value=NOT_LEARNED)
    return aux, embedded, torch.arange(aux.shape[1]).expand(len(sequences), -1), target_hidden, labels


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

    def batch(pool: list) -> list[torch.Tensor]:
        """sampler.num_windows whole sequences' padded_batch, on device."""
        picks = sampler.pick(pool)
        read = features([index for _, index, _ in picks])
        sequences = [sequence_rows(ids, answer_start, hidden, aux, embeddings, to_vocab, unroll)
                     for (ids, _, answer_start), (hidden, aux) in zip(picks, read)]
        return [part.to(device) for part in padded_batch(sequences)]

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
