"""What a draft trains on and guesses among: the answers held out of training and the draft vocabulary."""
import torch

from llmc.draft.labels import OUT_OF_VOCAB

DRAFT_VOCAB_SIZE = 8192  # the draft guesses among the answers' most frequent tokens: its LM head costs a sixth of the target's
HELD_OUT_EVERY = 25  # every 25th answer stays out of training: the draft's top-1 on it is what serving can expect


def held_out_split(items: list) -> tuple[list, list]:
    """(training, held out): every HELD_OUT_EVERY-th item, the first included, stays out of training when there are two or more."""
    if len(items) < 2:
        return items, []
    return [item for index, item in enumerate(items) if index % HELD_OUT_EVERY], items[::HELD_OUT_EVERY]


def draft_vocabulary(answers: list[torch.Tensor], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The answers' DRAFT_VOCAB_SIZE most frequent token ids, and every token id's index among them (OUT_OF_VOCAB if none)."""
    vocab = most_frequent_tokens(answers, vocab_size, DRAFT_VOCAB_SIZE)
    to_vocab = torch.full((vocab_size,), OUT_OF_VOCAB, dtype=torch.long)
    to_vocab[vocab] = torch.arange(len(vocab))
    return vocab, to_vocab


def most_frequent_tokens(answers: list[torch.Tensor], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` token ids the answers use most (fewer when they use fewer), in id order."""
    counts = torch.bincount(torch.cat(answers), minlength=vocab_size)
    used = int((counts > 0).sum())
    return counts.argsort(descending=True, stable=True)[: min(size, used)].sort().values
