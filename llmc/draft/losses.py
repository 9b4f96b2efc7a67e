"""The losses draft heads train with: Medusa's per-head cross-entropy, EAGLE's feature regression plus token loss,
and EAGLE-3's token loss against the target's distribution, both unrolled over several drafting steps as serving
drafts (EAGLE-3's training-time test)."""
import torch
import torch.nn.functional as F

from llmc.draft.labels import NOT_LEARNED
from llmc.draft.sequences import SequenceBatch, gathered_rows
from llmc.runtime.speculative.eagle import EagleDraft
from llmc.runtime.speculative.eagle3 import Eagle3Draft
from llmc.runtime.speculative.medusa import MedusaHeads

LOSS_DECAY = 0.8  # weight of Medusa head k is LOSS_DECAY ** k: far guesses are rarely accepted, so they matter less
TOKEN_LOSS_WEIGHT = 0.1  # the token loss through the LM head, next to the feature regression
INPUT_NOISE = 0.2  # uniform noise on input features in training, in units of the features' RMS: drafting feeds its own guesses back


def medusa_labels(token_ids: list[int], start: int, num_heads: int) -> torch.Tensor:
    """Row t (from start) holds the tokens at t + 2, ..., t + num_heads + 1 that the heads must guess."""
    rows = [[token_ids[t + k + 2] if t + k + 2 < len(token_ids) else NOT_LEARNED for k in range(num_heads)]
            for t in range(start, len(token_ids) - 1)]
    return torch.tensor(rows, dtype=torch.long)


def medusa_loss(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """hidden [N, hidden], labels [N, num_heads] as indices into the draft vocabulary (negative: no loss)."""
    logits, labels = heads(hidden), labels.masked_fill(labels < 0, NOT_LEARNED)
    losses = [F.cross_entropy(logits[k], labels[:, k], ignore_index=NOT_LEARNED) for k in range(heads.num_heads)]
    return sum(LOSS_DECAY**k * loss for k, loss in enumerate(losses))


def unrolled(
    draft: EagleDraft | Eagle3Draft, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, unroll: int,
    deep_rows: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Windows of `tokens` pairs drafted `unroll` steps deep as in serving (EAGLE-3's training-time test): step
    s > 0 feeds the features step s - 1 predicted back in with the tokens after them, attending to the true
    pairs before it and to its own chain of guesses. features [batch, tokens, hidden], embeddings [batch,
    tokens + unroll - 1, hidden] of the token after each feature, positions [batch, tokens] of the pairs; deep_rows
    [batch, rows]: the rows the steps past the first draft (None: every row). Returns each step's predicted features
    [batch, tokens or rows, hidden]: step s at row i guesses feature i + s + 1."""
    batch, tokens = positions.shape
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=features.device).tril()
    own_chain = torch.eye(tokens if deep_rows is None else deep_rows.shape[1], dtype=torch.bool, device=features.device)
    if deep_rows is not None:  # per sequence: the masks of the deeper steps are [batch, 1, rows, keys]
        deep_causal, own_chain = causal[deep_rows], own_chain.expand(batch, -1, -1)
    inputs, past, steps = features, None, []
    for step in range(unroll):
        if step == 0 or deep_rows is None:
            mask = torch.cat([causal] + [own_chain] * step, 1)
            embedded, at = embeddings[:, step : step + tokens], positions + step
        else:
            if step == 1:
                inputs = gathered_rows(inputs, deep_rows)
            mask = torch.cat([deep_causal] + [own_chain] * step, -1)[:, None]
            embedded, at = gathered_rows(embeddings, deep_rows + step), positions.gather(1, deep_rows) + step
        inputs, keys, values = draft(inputs, embedded, at, mask, past)
        past = (keys, values) if past is None else (torch.cat([past[0], keys], 1), torch.cat([past[1], values], 1))
        steps.append(inputs)
    return steps


def eagle_loss(draft: EagleDraft, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
               lm_head: torch.Tensor, noise_scale: float, unroll: int) -> torch.Tensor:
    """`unrolled` on noisy features, each step's feature regression plus token loss averaged. features [batch,
    tokens + unroll, hidden] the target's, labels [batch, tokens + unroll - 1] the token after each next
    feature as an index into lm_head (NOT_LEARNED: no loss, OUT_OF_VOCAB: the feature loss only), lm_head [vocab,
    hidden] frozen, the draft vocabulary's rows."""
    tokens = positions.shape[1]
    inputs = features[:, :tokens]
    noisy = inputs + (torch.rand_like(inputs) - 0.5) * INPUT_NOISE * noise_scale
    total = features.new_zeros(())
    for step, predicted in enumerate(unrolled(draft, noisy, embeddings, positions, unroll)):
        step_labels = labels[:, step : step + tokens]
        answer, in_vocab = step_labels != NOT_LEARNED, step_labels >= 0
        feature_loss = F.smooth_l1_loss(predicted[answer], features[:, step + 1 : step + 1 + tokens][answer])
        token_loss = F.cross_entropy(predicted[in_vocab] @ lm_head.T, step_labels[in_vocab])
        total = total + feature_loss + TOKEN_LOSS_WEIGHT * token_loss
    return total / unroll


def eagle3_loss(draft: Eagle3Draft, batch: SequenceBatch, lm_head: torch.Tensor, unroll: int) -> torch.Tensor:
    """`unrolled` from the fused target features over the batch's rows (deep_rows past the first step), each step's
    cross-entropy against the target's own next-token distribution over the draft vocabulary (soft labels: the
    target's logits carry more than its greedy token) on the rows whose guess is an answer token the draft can
    guess, step s weighted LOSS_DECAY ** s. lm_head [vocab, hidden]: the target's rows of the draft vocabulary."""
    total, weights = batch.aux.new_zeros((), dtype=torch.float32), 0.0
    steps = unrolled(draft, draft.combine(batch.aux), batch.embedded, batch.positions, unroll, batch.deep_rows)
    for step, predicted in enumerate(steps):
        rows = batch.step_labels(step) >= 0
        with torch.no_grad():
            target = (batch.at_step(batch.target_hidden, step)[rows] @ lm_head.T).float().softmax(-1)
        log_probs = draft.logits(predicted[rows]).float().log_softmax(-1)
        total = total + LOSS_DECAY**step * -(target * log_probs).sum() / rows.sum().clamp(min=1)
        weights += LOSS_DECAY**step
    return total / weights
