"""EAGLE-3's training batches: whole sequences (prompt and answer) padded at their end into one batch. Row t of a
sequence pairs the fused target features at t with token t + 1; drafting step s there guesses token t + s + 2,
learned on the answer's tokens only. Steps past the first draft only the rows from which some step reaches the
answer (`deep_rows`): a prompt row's deeper guesses are never learned, and nothing else attends to them, as each
deeper step attends to the first step's rows and to its own chain only."""
from dataclasses import dataclass, fields

import torch
from torch.nn.utils.rnn import pad_sequence

from llmc.draft.labels import NOT_LEARNED


def gathered_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor [batch, tokens, hidden] at rows [batch, n] -> [batch, n, hidden]."""
    return tensor.gather(1, rows[..., None].expand(-1, -1, tensor.shape[-1]))


def sequence_rows(ids: torch.Tensor, answer_start: int, hidden: torch.Tensor, aux: torch.Tensor, embeddings: torch.Tensor,
                  to_vocab: torch.Tensor, unroll: int) -> tuple[torch.Tensor, ...]:
    """One whole sequence's training rows: the aux features of the rows that have unroll tokens after them, then the
    embeddings and target final states of the token after each row and the unroll - 1 past the last, the
    draft-vocabulary index of the token each (row, step) guesses (row t at step s guesses token t + s + 2;
    NOT_LEARNED before the answer), and the rows the deeper steps draft (those whose last step guesses an answer token)."""
    labels = torch.where(torch.arange(2, len(ids)) >= answer_start, to_vocab[ids[2:]], NOT_LEARNED)
    rows = len(ids) - unroll - 1
    deep_rows = torch.arange(min(max(0, answer_start - unroll - 1), rows), rows)
    return aux[:rows].float(), embeddings[ids[1:-1]], hidden[1 : len(ids) - 1], labels, deep_rows


@dataclass(slots=True)
class SequenceBatch:
    aux: torch.Tensor  # [batch, rows, layers * hidden] the target features the first step fuses
    embedded: torch.Tensor  # [batch, rows + unroll - 1, hidden] the token after each row, and those past the last row
    positions: torch.Tensor  # [batch, rows]
    target_hidden: torch.Tensor  # [batch, rows + unroll - 1, hidden] the target's final states, one position on
    labels: torch.Tensor  # [batch, rows + unroll - 1] the token step s at row t guesses sits at t + s (NOT_LEARNED: none)
    real_rows: torch.Tensor  # [batch, rows] False on padding, whose shifted labels may be its sequence's last tokens
    deep_rows: torch.Tensor  # [batch, deep] the rows steps past the first draft, padded with row 0 ...
    deep_real: torch.Tensor  # [batch, deep] ... where this is False

    def to(self, device: torch.device | str) -> "SequenceBatch":
        return SequenceBatch(*(getattr(self, field.name).to(device) for field in fields(self)))

    def at_step(self, tensor: torch.Tensor, step: int) -> torch.Tensor:
        """tensor's entries (embedded, target_hidden or labels) for the rows drafting step `step` drafts, shifted by
        step: every row at the first step, deep_rows after it."""
        if step == 0:
            return tensor[:, : self.positions.shape[1]]
        return gathered_rows(tensor, self.deep_rows + step) if tensor.dim() == 3 else tensor.gather(1, self.deep_rows + step)

    def step_labels(self, step: int) -> torch.Tensor:
        """The labels of the rows drafting step `step` drafts (padding: NOT_LEARNED)."""
        return self.at_step(self.labels, step).masked_fill(~(self.real_rows if step == 0 else self.deep_real), NOT_LEARNED)


def padded_batch(sequences: list[tuple[torch.Tensor, ...]]) -> SequenceBatch:
    """sequence_rows of several sequences, each padded at its end: causal attention keeps the padding out of every real
    row, and no padding row is learned (its labels, shifted by a step, may be its sequence's last tokens)."""
    *features, labels, deep_rows = zip(*sequences)
    aux, embedded, target_hidden = (pad_sequence(list(group), batch_first=True) for group in features)
    labels = pad_sequence(list(labels), batch_first=True, padding_value=NOT_LEARNED)
    real_rows, deep_real = (pad_sequence([torch.ones(len(rows), dtype=torch.bool) for rows in group], batch_first=True)
                            for group in (features[0], deep_rows))
    positions = torch.arange(aux.shape[1]).expand(len(sequences), -1)
    return SequenceBatch(aux, embedded, positions, target_hidden, labels, real_rows, pad_sequence(list(deep_rows), batch_first=True),
                         deep_real)
