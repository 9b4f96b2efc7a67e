"""What a draft trains on and guesses among: the answers held out of training, training windows and the draft vocabulary."""
import torch

from llmc.draft.losses import OUT_OF_VOCAB

DRAFT_VOCAB_SIZE = 8192  # the draft guesses among the answers' most frequent tokens: its LM head costs a sixth of the target's
EAGLE_WINDOW = 128  # tokens per EAGLE training window (fewer when the answers are shorter)
EVAL_BATCHES = 8  # held-out batches an EAGLE draft's top-1 is measured on
HELD_OUT_EVERY = 25  # every 25th answer stays out of training: the draft's top-1 on it is what serving can expect


def held_out_split(items: list) -> tuple[list, list]:
    """(training, held out): every HELD_OUT_EVERY-th item, the first included, stays out of training when there are two or more."""
    if len(items) < 2:
        return items, []
    return [item for index, item in enumerate(items) if index % HELD_OUT_EVERY], items[::HELD_OUT_EVERY]


def window_length(token_ids: list[list[int]], unroll: int) -> int:
    """EAGLE_WINDOW tokens, or fewer where the answers are shorter: at least half of them hold a window and the
    unroll - 1 tokens past it (windows start anywhere in an answer, so longer ones still train whole)."""
    median = sorted(map(len, token_ids))[len(token_ids) // 2]
    return max(1, min(EAGLE_WINDOW, median - unroll - 1))


def held_out_windows(seqs: list[tuple], min_len: int) -> tuple[list, list]:
    """held_out_split of every answer (ids first, answer start last in each tuple), then in each part the answers long
    enough for an EAGLE window: the held-out answers are the same every 25th whatever the method."""
    def long_enough(part: list[tuple]) -> list[tuple]:
        return [seq for seq in part if len(seq[0]) >= min_len and seq[-1] + 1 < len(seq[0])]

    training, held_out = held_out_split(seqs)
    return long_enough(training), long_enough(held_out)


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
