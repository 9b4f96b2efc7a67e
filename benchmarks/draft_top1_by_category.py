"""Where an EAGLE-3 draft misses, by MT-bench category: the target answers every first turn (greedy, 128 tokens, the
self-distillation engine, keeping the draft's aux features), then the draft is run teacher-forced over each answer
as training unrolls it. Per category: the share of answer tokens each drafting step ranks first, the share of rows
whose chain of 1 / 2 / 3 guesses is all right (their sum + 1 estimates the mean accepted length of a chain of 3: an
average over answer positions, above what decoding measures, as decoding starts more of its steps in hard stretches),
and the share of answer tokens outside the draft vocabulary.

    python benchmarks/draft_top1_by_category.py ARTIFACT [--prompts ../shared/data/mt_bench/question.jsonl]
"""
import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from llmc.artifact.reader import DRAFT_DIR
from llmc.draft.data import self_distill
from llmc.draft.losses import unrolled
from llmc.runtime.models.loader import WeightLoader
from llmc.runtime.speculative.store import load_draft

ROOT = Path(__file__).resolve().parents[1]
MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
STEPS = 3
MAX_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    config, draft = load_draft(args.artifact / DRAFT_DIR, torch.float32, "cpu")
    if config["method"] != "eagle3":
        raise SystemExit(f"{args.artifact}: an eagle3 draft is needed, this one is {config['method']}")
    with tempfile.TemporaryDirectory() as work:
        prompts = Path(work) / "prompts.jsonl"  # first turns only, as the engine reads a training file
        prompts.write_text("".join(json.dumps({"prompt": row["turns"][0]}) + "\n" for row in rows))
        data = self_distill(args.artifact, prompts, len(rows), MAX_TOKENS, Path(work) / "parts",
                            aux_layers=tuple(config["aux_layer_ids"]))
    embeddings = WeightLoader(args.artifact, torch.float32, "cpu").tensor("model.embed_tokens.weight")
    in_vocab = torch.zeros(len(embeddings), dtype=torch.bool)
    in_vocab[draft.vocab] = True
    counts = defaultdict(lambda: torch.zeros(2 * STEPS + 2))  # tokens, top-1 per step, chains per length, outside vocab
    with torch.no_grad():
        for row, ids, aux, answer_start in zip(rows, data.token_ids, data.aux, data.answer_starts):
            ids, tokens = torch.tensor(ids), len(ids) - 1 - STEPS  # row t at step s guesses token t + s + 2
            if tokens + 2 <= answer_start:
                continue
            steps = unrolled(draft, draft.combine(aux[:tokens].float()[None]), embeddings[ids[1 : tokens + STEPS]][None],
                             torch.arange(tokens)[None], STEPS)
            answer = torch.arange(tokens) + 2 >= answer_start
            hits = [(draft.vocab[draft.logits(out[0]).argmax(-1)] == ids[2 + s : tokens + 2 + s])[answer] for s, out in enumerate(steps)]
            chains = torch.stack(hits).cumprod(0)
            counts[row.get("category", "all")] += torch.tensor(
                [len(hits[0])] + [h.sum() for h in hits] + [c.sum() for c in chains] + [(~in_vocab[ids[2 : tokens + 2][answer]]).sum()],
                dtype=torch.float)
    counts["ALL"] = sum(counts.values())
    print(f"{'category':12} {'tokens':>6}  top-1 per step        chain of 1/2/3 right   ~accepted  outside vocab")
    for category, count in counts.items():
        shares = count[1:] / count[0]
        top1, chains, outside = shares[:STEPS], shares[STEPS : 2 * STEPS], shares[-1]
        print(f"{category:12} {int(count[0]):6d}  {' '.join(f'{v:.3f}' for v in top1)}   {' '.join(f'{v:.3f}' for v in chains)}"
              f"      {1 + chains.sum():.2f}      {outside:.3f}")


if __name__ == "__main__":
    main()
