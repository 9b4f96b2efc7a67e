"""Training windows over self-distilled answers for EAGLE: `window_len` rows that start anywhere from a quarter window
before the answer, the unroll - 1 tokens past them that the deeper drafting steps need, and a label on every answer
token the window's rows guess. EAGLE-3 trains on whole sequences, drawn and scored by the same sampler."""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmc.draft.labels import NOT_LEARNED
from llmc.draft.vocabulary import held_out_split

EAGLE_WINDOW = 128  # tokens per EAGLE training window (fewer when the answers are shorter)
EVAL_BATCHES = 8  # batches an EAGLE draft's top-1 is measured on, in training and held out (one batch is too few to compare)


@dataclass(slots=True)
class WindowSampler:
    window_len: int
    unroll: int
    num_windows: int  # windows a batch stacks
    generator: torch.Generator

    def span(self, ids: torch.Tensor, answer_start: int, to_vocab: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A random window's first row, and the draft-vocabulary index of the token each (row, step) guesses: row t at
        step s guesses token t + s + 2 (labels [window_len + unroll - 1], NOT_LEARNED before the answer)."""
        first = max(0, min(answer_start - 2 - self.window_len // 4, len(ids) - self.window_len - self.unroll - 1))
        start = int(torch.randint(first, len(ids) - self.window_len - self.unroll, (), generator=self.generator))
        end = start + self.window_len
        guessed = torch.arange(start + 2, end + self.unroll + 1)
        return start, torch.where(guessed >= answer_start, to_vocab[ids[start + 2 : end + self.unroll + 1]], NOT_LEARNED)

    def pick(self, pool: list[tuple]) -> list[tuple]:
        """num_windows answers drawn from pool."""
        return [pool[index] for index in torch.randint(len(pool), (self.num_windows,), generator=self.generator).tolist()]

    def batch(self, pool: list[tuple], window: Callable[..., tuple[torch.Tensor, ...]],
              device: torch.device | str) -> list[torch.Tensor]:
        """num_windows answers drawn from pool, each cut by window(*answer), the parts stacked and moved to device."""
        return [torch.stack(parts).to(device) for parts in zip(*(window(*answer) for answer in self.pick(pool)))]

    def top1_per_step(self, guess_batch: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]], num_batches: int) -> list[float]:
        """Per drafting step, the share of answer tokens the draft ranks first over num_batches batches; guess_batch
        returns per step its guesses [batch, rows] as draft-vocabulary indices and the labels of those rows (a token
        outside the draft vocabulary counts as missed)."""
        hits, counted = torch.zeros(self.unroll), torch.zeros(self.unroll)
        with torch.no_grad():
            for _ in range(num_batches):
                for step, (guess, labels) in enumerate(guess_batch()):
                    answer = labels != NOT_LEARNED
                    hits[step] += (guess == labels)[answer].sum().cpu()
                    counted[step] += answer.sum().cpu()
        return [round(value, 4) for value in (hits / counted.clamp(min=1)).tolist()]

    def train_summary(self, steps: int, lr: float, losses: list[float], guesses: Callable[[list], list[tuple[torch.Tensor, torch.Tensor]]],
                      training: list, held_out: list) -> dict:
        """The `train` fields of an EAGLE or EAGLE-3 draft's summary: its settings, final loss and top-1 per drafting
        step on training and held-out windows (guesses(pool): as top1_per_step's guess_batch, drawing from pool)."""
        return {"steps": steps, "batch_size": self.num_windows * self.window_len, "lr": lr, "final_loss": losses[-1],
                "unroll": self.unroll, "train_top1_per_step": self.top1_per_step(lambda: guesses(training), EVAL_BATCHES),
                "heldout_top1_per_step": self.top1_per_step(lambda: guesses(held_out), EVAL_BATCHES) if held_out else None}


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
