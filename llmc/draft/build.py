"""`llmc train-draft`: self-distil the artifact's model, train draft heads on it, and store them in ARTIFACT/draft."""
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm
from transformers import AutoConfig

from llmc.artifact.reader import DRAFT_DIR
from llmc.artifact.writer import MANIFEST, staged_copy, write_manifest
from llmc.core.errors import LlmcError
from llmc.core.prompts import check_prompt_files
from llmc.draft.config import DraftConfig
from llmc.draft.data import DistillSet, cached_self_distill, distill_engine
from llmc.draft.eagle3 import train_eagle3
from llmc.draft.features import OnlineFeatures, StoredFeatures, check_stored_features_fit, feature_mode
from llmc.draft.labels import NOT_LEARNED
from llmc.draft.losses import eagle_loss, medusa_labels, medusa_loss, unrolled
from llmc.draft.train import TrainConfig, train
from llmc.draft.vllm_export import VLLM_DIR, VLLM_METHODS, export_for_vllm
from llmc.draft.vocabulary import draft_vocabulary, held_out_split
from llmc.draft.windows import WindowSampler, held_out_windows, window_length
from llmc.runtime.engine.config import EngineConfig, native_bfloat16
from llmc.runtime.llm import LLM
from llmc.runtime.models.llama import aux_layer_ids
from llmc.runtime.models.loader import WeightLoader
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.speculative.eagle import EagleDraft, EagleShape
from llmc.runtime.speculative.eagle3 import default_aux_layers
from llmc.runtime.speculative.medusa import MedusaHeads
from llmc.runtime.speculative.shape import COMPARISON_CHAIN
from llmc.runtime.speculative.store import save_draft, save_heads

HELD_OUT_PROMPTS = 32  # held-out prompts a draft's acceptance is measured on, one at a time (batch 1, as the gate reads it)
HELD_OUT_MAX_TOKENS = 128


def train_draft_into_copy(artifact: Path, config: DraftConfig, device: torch.device | str = "cpu") -> Path:
    """`llmc train-draft` on a finished artifact: the draft is trained into a staging copy of it (its files hard links
    but the manifest, a real copy, and without the old draft), which then takes the artifact's place (the old one
    renamed aside, the copy renamed in, the old one removed); an error or Ctrl-C leaves the artifact as it was."""
    require_artifact(artifact)
    with staged_copy(artifact, rewritten={MANIFEST}, dropped={DRAFT_DIR}) as staging:
        train_draft(staging, config, device)
    return artifact / DRAFT_DIR


def require_artifact(folder: Path) -> None:
    if not (folder / MANIFEST).is_file():
        raise LlmcError(f"{folder} is not an llmc artifact (no {MANIFEST})")


def train_draft(artifact: Path, config: DraftConfig, device: torch.device | str = "cpu") -> Path:
    """Train draft heads into ARTIFACT/draft, in place (`llmc quantize` trains them in its staging folder). The target
    answers the prompts through the runtime on device, and the heads train there; the answers' features stay in host
    memory, each training batch moved to the device."""
    device = torch.device(device)
    require_artifact(artifact)
    check_prompt_files(config.prompts)
    aux_layers, features = checked_draft_inputs(artifact, config, device)
    started = time.perf_counter()
    data = DistillSet.joined([cached_self_distill(artifact, Path(file), config.num_prompts, config.max_tokens, device,
                                                  tuple(aux_layers), keep_features=features == "stored") for file in config.prompts])
    distill_s = time.perf_counter() - started
    folder = artifact / DRAFT_DIR
    if config.method == "eagle":
        summary = train_eagle(data, config, folder, artifact, device)
    elif config.method == "eagle3":
        summary = save_eagle3(data, features, config, aux_layers, folder, artifact, device)
    else:
        summary = train_medusa(data, config, folder, device)
    summary["train"] |= {"device": str(device), "distill_s": round(distill_s, 1)}
    save_draft(folder, summary)
    summary["heldout_acceptance"] = held_out_acceptance(artifact, folder, data, device)
    summary["train"]["total_s"] = round(time.perf_counter() - started, 1)
    save_draft(folder, summary)
    if summary["method"] in VLLM_METHODS:
        export_for_vllm(folder, folder / VLLM_DIR)
    manifest = json.loads((artifact / MANIFEST).read_text())
    write_manifest(artifact, manifest | {"draft": summary})
    return folder


def held_out_acceptance(artifact: Path, folder: Path, data: DistillSet, device: torch.device) -> dict | None:
    """The draft's mean accepted length on the prompts of the answers held out of training (the first HELD_OUT_PROMPTS),
    greedy, drafting a chain of COMPARISON_CHAIN tokens on every step: what the gate's min_accepted_length holds."""
    held_out = held_out_split(list(zip(data.token_ids, data.answer_starts)))[1][:HELD_OUT_PROMPTS]
    if not held_out:
        return None
    dtype = torch.bfloat16 if native_bfloat16(str(device)) else torch.float32
    engine = LLM(artifact, EngineConfig(
        device=str(device), dtype=dtype, speculative=folder, adaptive_speculation=False, enable_prefix_caching=False,
        num_speculative_tokens=COMPARISON_CHAIN, speculative_tree_nodes=0, speculative_min_confidence=0.0,
    ))
    params = SamplingParams(temperature=0, max_tokens=HELD_OUT_MAX_TOKENS)
    for ids, start in tqdm(held_out, desc="draft on held-out prompts", unit="prompt"):
        engine.generate([ids[:start]], params)
    return {"chain": COMPARISON_CHAIN, "num_prompts": len(held_out), "max_tokens": HELD_OUT_MAX_TOKENS,
            "mean_accepted_length": round(engine.runner.speculator.stats.mean_accepted_length, 4)}


def trained_on(config: DraftConfig, data: DistillSet, num_held_out: int) -> dict:
    """What a draft's summary says it learned from."""
    return {"prompts": config.prompts, "num_answers": len(data.token_ids), "num_held_out": num_held_out,
            "answer_tokens": data.num_answer_tokens}


def checked_draft_inputs(model: Path, config: DraftConfig, device: torch.device) -> tuple[list[int], Literal["stored", "online"]]:
    """The draft's aux layers and where it reads the target's features, with the memory and disk its stored features
    will take checked against the artifact or, before quantizing, against the model it will be made of (memory alone:
    which sets are cached is the artifact's to say)."""
    aux_layers = eagle3_aux_layers(model, config) if config.method == "eagle3" else []
    features = feature_mode(config, device)
    if features == "stored":
        check_stored_features_fit(model, config, aux_layers)
    return aux_layers, features


def eagle3_aux_layers(artifact: Path, config: DraftConfig) -> list[int]:
    """The recipe's aux layers, checked against the model before any work; by default EAGLE-3's choice."""
    num_layers = AutoConfig.from_pretrained(artifact).num_hidden_layers
    return list(aux_layer_ids(config.aux_layers or default_aux_layers(num_layers), num_layers, f"{artifact}: draft.aux_layers"))


def save_eagle3(data: DistillSet, features: Literal["stored", "online"], config: DraftConfig, aux_layers: list[int],
                folder: Path, artifact: Path, device: torch.device | str = "cpu") -> dict:
    """Train an EAGLE-3 draft into folder, reading the target's features as `features` says; returns the summary that
    goes in its config.json."""
    source = StoredFeatures(data) if features == "stored" else OnlineFeatures(
        distill_engine(artifact, device, tuple(aux_layers)), data.token_ids)
    draft, trained = train_eagle3(data, source, config, aux_layers, folder, artifact, device)
    trained["train"]["features"] = features
    summary = {
        "method": "eagle3", "hidden_size": draft.config.target_hidden_size, "aux_layer_ids": aux_layers,
        "config": draft.config.to_dict(),
        "trained_on": trained_on(config, data, trained["num_held_out"]),
        "train": trained["train"],
    }
    save_heads(folder, draft)
    save_draft(folder, summary)
    return summary


def medusa_rows(
    seqs: list[tuple[list[int], torch.Tensor, int]], to_vocab: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The answer positions' features [N, hidden] and what each head must guess there [N, num_heads], as draft
    vocabulary indices (OUT_OF_VOCAB: a token no head can guess, NOT_LEARNED: past the answer's end)."""
    hidden = torch.cat([h[start - 1 :] for _, h, start in seqs])
    labels = torch.cat([medusa_labels(ids, start - 1, num_heads) for ids, _, start in seqs])
    return hidden, torch.where(labels >= 0, to_vocab[labels.clamp(min=0)], labels)


def medusa_top1(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor, chunk: int = 4096) -> list[float]:
    """Per head, the share of positions whose token it ranks first (a token outside the draft vocabulary counts as missed)."""
    hits, counted = torch.zeros(heads.num_heads), torch.zeros(heads.num_heads)
    device = next(heads.parameters()).device
    with torch.no_grad():
        for first in range(0, len(hidden), chunk):
            guesses, truth = heads(hidden[first : first + chunk].to(device)).argmax(-1).T.cpu(), labels[first : first + chunk]
            hits += ((guesses == truth) & (truth != NOT_LEARNED)).sum(0)
            counted += (truth != NOT_LEARNED).sum(0)
    return [round(value, 4) for value in (hits / counted.clamp(min=1)).tolist()]


def train_medusa(data: DistillSet, config: DraftConfig, folder: Path, device: torch.device | str = "cpu") -> dict:
    """Train Medusa heads on self-distilled data into folder; returns the summary that goes in its config.json."""
    training, held_out = held_out_split(list(zip(data.token_ids, data.hidden, data.answer_starts)))
    vocab, to_vocab = draft_vocabulary([torch.tensor(ids[start:]) for ids, _, start in training], len(data.lm_head))
    hidden, labels = medusa_rows(training, to_vocab, config.num_heads)
    torch.manual_seed(config.seed)  # the heads' initial weights
    heads = MedusaHeads.from_lm_head(data.lm_head, vocab, config.num_heads)
    generator = torch.Generator().manual_seed(config.seed)

    def loss_fn(step: int) -> torch.Tensor:
        rows = torch.randint(len(hidden), (config.batch_size,), generator=generator)
        return medusa_loss(heads, hidden[rows].to(device), labels[rows].to(device))

    train_config = TrainConfig(steps=config.steps, lr=config.lr, seed=config.seed)
    losses = train(heads, loss_fn, train_config, folder, f"medusa heads ({config.num_heads})", device)
    summary = {
        "method": "medusa", "num_heads": config.num_heads, "hidden_size": hidden.shape[1], "draft_vocab_size": len(vocab),
        "trained_on": trained_on(config, data, len(held_out)),
        "train": {"steps": config.steps, "batch_size": config.batch_size, "lr": config.lr, "final_loss": losses[-1],
                  "train_top1_per_head": medusa_top1(heads, hidden[-4096:], labels[-4096:]),
                  "heldout_top1_per_head": medusa_top1(heads, *medusa_rows(held_out, to_vocab, config.num_heads)) if held_out else None},
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


def train_eagle(data: DistillSet, config: DraftConfig, folder: Path, artifact: Path,
                device: torch.device | str = "cpu") -> dict:
    """Windows of (feature at t, token t + 1) pairs; the draft learns the feature at t + 1 and the token t + 2 it
    leads to. Only answer tokens are learned, with the cross-entropy over the draft's vocabulary (the answers' most
    frequent tokens: a rarer one is learned through its feature alone)."""
    embeddings = WeightLoader(artifact, torch.float32, "cpu").tensor("model.embed_tokens.weight")
    unroll = config.unroll
    window_len = window_length(data.token_ids, unroll)
    seqs = [(torch.tensor(ids), hidden, start) for ids, hidden, start in zip(data.token_ids, data.hidden, data.answer_starts)]
    training, held_out = held_out_windows(seqs, window_len + unroll + 1)
    vocab, to_vocab = draft_vocabulary([ids[start:] for ids, _, start in training], len(data.lm_head))
    lm_head = data.lm_head[vocab].to(device)
    noise_scale = torch.cat([hidden for _, hidden, _ in training]).pow(2).mean().sqrt().item()
    shape = eagle_shape(artifact, len(vocab))
    torch.manual_seed(config.seed)  # the draft's initial weights
    draft = EagleDraft(shape)
    draft.vocab.copy_(vocab)
    sampler = WindowSampler(window_len, unroll, max(1, config.batch_size // window_len), torch.Generator().manual_seed(config.seed))

    def window(ids: torch.Tensor, hidden: torch.Tensor, answer_start: int) -> tuple[torch.Tensor, ...]:
        """Pairs start..end - 1, and the unroll - 1 features and tokens past them that the deeper steps need."""
        start, labels = sampler.span(ids, answer_start, to_vocab)
        end = start + window_len
        return hidden[start : end + unroll], embeddings[ids[start + 1 : end + unroll]], torch.arange(start, end), labels

    def loss_fn(step: int) -> torch.Tensor:
        return eagle_loss(draft, *sampler.batch(training, window, device), lm_head, noise_scale, unroll)

    def guesses(pool: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each unrolled step's guesses, drafting from the target's features, and their labels."""
        features, embedded, positions, labels = sampler.batch(pool, window, device)
        steps = unrolled(draft, features[:, :window_len], embedded, positions, unroll)
        return [((predicted @ lm_head.T).argmax(-1), labels[:, step : step + window_len]) for step, predicted in enumerate(steps)]

    train_config = TrainConfig(steps=config.steps, lr=config.lr, seed=config.seed)
    losses = train(draft, loss_fn, train_config, folder, "eagle draft", device)
    summary = {
        "method": "eagle", "hidden_size": shape.hidden_size, "shape": asdict(shape),
        "trained_on": trained_on(config, data, len(held_out)),
        "train": sampler.train_summary(config.steps, config.lr, losses, guesses, training, held_out),
    }
    save_heads(folder, draft)
    save_draft(folder, summary)
    return summary
