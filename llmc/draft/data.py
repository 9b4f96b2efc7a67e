"""Self-distillation: the quantized target answers the training prompts with the runtime engine (greedy), keeping
the final hidden state of every token it computes (prompt and answer): the features the heads learn from come from
the generation itself, not a second pass over prompt + answer, which cost 40% as much again. The engine runs the
artifact's own weights dequantized onto dense matmuls (`EngineConfig.dense_weights`), in float32 on a CPU that only
emulates bfloat16: the served model up to rounding, and on CPU much faster than torch's int4 kernel, whose time grows
with the rows of a step (SmolLM2's two prompt sets: 43 min instead of 96 on a CPU with bfloat16 matmuls). The set is
cached (safetensors) under LLMC_HOME/distill, one file per prompt file, keyed by the artifact, the prompts, the lengths
and the layers whose residual stream an EAGLE-3 draft fuses (kept beside the final states when asked for). Without
features (an EAGLE-3 draft reading them online, draft.features) the set holds the answers' token ids alone."""
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from llmc.artifact.reader import DRAFT_DIR
from llmc.artifact.resume import REPORT_DIR
from llmc.artifact.writer import MANIFEST, RECIPE
from llmc.checkpoints.spec import llmc_home
from llmc.core.errors import LlmcError
from llmc.core.prompts import check_not_eval_set, distinct_prompts, read_prompt_texts
from llmc.core.staging import unique_sibling
from llmc.runtime.engine.config import EngineConfig, native_bfloat16
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

DISTILL_SEQS = 128  # answers generated side by side: on CPU, wider float32 matmuls cost less per token
DISTILL_KV_GIB = 2.0  # their KV cache in float32 (46 KiB a token for SmolLM2): no preemption at 128 x ~250 tokens
DISTILL_PART = 256  # answers saved together as they finish: an interrupted distillation resumes from those it saved
DISTILL_MAX_LEN = 1024  # tokens of prompt + answer
NOT_THE_MODEL = {REPORT_DIR, DRAFT_DIR, RECIPE}  # an artifact's files that do not change its answers


@dataclass(slots=True)
class Answer:
    token_ids: list[int]  # prompt + the target's own answer
    hidden: torch.Tensor | None  # [len - 1, hidden] float32; None: features not kept
    answer_start: int
    aux: torch.Tensor | None = None  # [len - 1, layers * hidden] bfloat16: the residual stream entering the aux layers


@dataclass(slots=True)
class DistillSet:
    token_ids: list[list[int]]  # prompt + the target's own answer
    hidden: list[torch.Tensor] | None  # [len - 1, hidden] float32 final hidden states, one per token but the last; None: answers only
    answer_starts: list[int]  # index of the first answer token
    lm_head: torch.Tensor  # [vocab, hidden] float32, the target's output projection as served
    aux: list[torch.Tensor] | None = None  # [len - 1, layers * hidden] bfloat16 each, with aux layers

    @classmethod
    def joined(cls, parts: list["DistillSet"]) -> "DistillSet":
        """Sets distilled from one model (one LM head) on several prompt files, as one."""
        return cls(
            [ids for part in parts for ids in part.token_ids],
            None if parts[0].hidden is None else [hidden for part in parts for hidden in part.hidden],
            [start for part in parts for start in part.answer_starts], parts[0].lm_head,
            None if parts[0].aux is None else [aux for part in parts for aux in part.aux],
        )

    @property
    def num_answer_tokens(self) -> int:
        return sum(len(ids) - start for ids, start in zip(self.token_ids, self.answer_starts))


def distill_engine(artifact: Path, device: torch.device | str, aux_layers: tuple[int, ...] = (), keep_features: bool = True,
                   max_len: int = DISTILL_MAX_LEN) -> LLM:
    """The runtime engine the target's answers and features come from: its own weights dequantized onto dense matmuls,
    every token's final hidden state kept (and the aux layers' residual stream) with keep_features."""
    device = torch.device(device)
    dtype = torch.bfloat16 if native_bfloat16(str(device)) else torch.float32  # emulated bfloat16 is slower than float32
    return LLM(artifact, EngineConfig(device=str(device),
        enable_prefix_caching=False, max_model_len=max_len, dtype=dtype, dense_weights=True, keep_hidden_states=keep_features,
        max_num_seqs=DISTILL_SEQS, max_num_batched_tokens=2 * 512, kv_cache_gib=DISTILL_KV_GIB,
        aux_hidden_layers=aux_layers if keep_features else (),
    ))


def self_distill(artifact: Path, prompts_file: Path, num_prompts: int, max_tokens: int, parts: Path,
                 device: torch.device | str = "cpu", max_len: int = DISTILL_MAX_LEN, aux_layers: tuple[int, ...] = (),
                 keep_features: bool = True) -> DistillSet:
    """The target's answers to the file's prompts, saved DISTILL_PART answers at a time into the folder `parts` as
    they finish: answers an interrupted run saved there are read back instead of generated again."""
    check_not_eval_set(prompts_file)
    device = torch.device(device)
    engine = distill_engine(artifact, device, aux_layers, keep_features, max_len)
    prompts = distinct_prompts(prompts_file, num_prompts, engine.tokenizer)
    prompts = [prompt for prompt in prompts if len(engine.tokenize(prompt)) + max_tokens < engine.max_model_len]
    if not prompts:
        raise LlmcError(f"no prompt of {prompts_file} fits {engine.max_model_len} tokens with a {max_tokens}-token answer")
    answers = answer_prompts(engine, prompts, max_tokens, parts)
    hidden_size = engine.runner.hf_config.hidden_size
    identity = torch.eye(hidden_size, dtype=engine.config.dtype, device=device)
    lm_head = engine.runner.model.compute_logits(identity).T.to("cpu", torch.float32)
    token_ids, hidden, answer_starts, aux = columns([answers[index] for index in range(len(prompts))])
    return DistillSet(token_ids, hidden, answer_starts, lm_head, aux)


def columns(answers: list[Answer]) -> tuple[list[list[int]], list[torch.Tensor] | None, list[int], list[torch.Tensor] | None]:
    """The answers' token ids, hidden states, answer starts and aux features, each as one list (DistillSet's fields)."""
    aux = None if answers[0].aux is None else [a.aux for a in answers]
    hidden = None if answers[0].hidden is None else [a.hidden for a in answers]
    return [a.token_ids for a in answers], hidden, [a.answer_start for a in answers], aux


def answer_prompts(engine: LLM, prompts: list[str], max_tokens: int, parts: Path) -> dict[int, Answer]:
    """Every prompt's answer by its index: those saved in `parts` read back, the others generated and saved there."""
    answers = load_parts(parts)
    seqs = {str(index): engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), str(index))
            for index, prompt in enumerate(prompts) if index not in answers}
    finished: dict[int, Answer] = {}
    with tqdm(total=len(prompts), initial=len(answers), desc="target answers its prompts", unit="answer") as progress:
        while engine.has_unfinished():
            for output in filter(lambda output: output.finish_reason is not None, engine.step()):
                seq = seqs.pop(output.request_id)  # every token but the last was computed once: the last is never fed back
                hidden, aux = sequence_features(seq)
                finished[int(output.request_id)] = Answer(seq.token_ids, hidden, seq.num_prompt_tokens, aux)
                progress.update()
            if len(finished) >= DISTILL_PART or (finished and not engine.has_unfinished()):
                save_answers(finished, parts / f"part-{len(list(parts.glob('part-*.safetensors'))):04d}.safetensors")
                answers |= finished
                finished = {}
    return answers


def sequence_features(seq: Sequence) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The final hidden states [tokens computed, hidden] float32 and aux features [.., layers * hidden] bfloat16 the
    engine kept for a sequence (None where it kept none)."""
    hidden = torch.cat(seq.hidden_states) if seq.hidden_states else None
    return hidden, torch.cat(seq.aux_hidden_states).bfloat16() if seq.aux_hidden_states else None


def cached_self_distill(artifact: Path, prompts_file: Path, num_prompts: int | None, max_tokens: int,
                        device: torch.device | str = "cpu", aux_layers: tuple[int, ...] = (),
                        keep_features: bool = True) -> DistillSet:
    """num_prompts: the first this many prompts of the file; None: all of them. The set is the model's, wherever it
    was computed: a set distilled on one device serves training on another."""
    check_not_eval_set(prompts_file)
    num_prompts = num_prompts or len(read_prompt_texts(prompts_file))
    path = distill_cache_path(artifact, prompts_file, num_prompts, max_tokens, aux_layers, keep_features)
    if path.is_file():
        return load_distill_set(path)
    parts = path.with_suffix(".parts")
    data = self_distill(artifact, prompts_file, num_prompts, max_tokens, parts, device, aux_layers=aux_layers,
                        keep_features=keep_features)
    save_distill_set(data, path)
    shutil.rmtree(parts)
    return data


def distill_cache_path(artifact: Path, prompts_file: Path, num_prompts: int | None, max_tokens: int,
                       aux_layers: tuple[int, ...] = (), keep_features: bool = True) -> Path:
    """Where the set of these answers (and features) is cached: keyed by what decides it, the model's files, the prompts
    and the settings; not by when or how fast the artifact was made, so `llmc quantize` and `llmc train-draft` share it."""
    num_prompts = num_prompts or len(read_prompt_texts(prompts_file))
    key = hashlib.sha256(b"\0".join([
        json.dumps(model_files(artifact), sort_keys=True).encode(), prompts_file.read_bytes(), f"{num_prompts},{max_tokens}".encode(),
    ] + ([f"aux {list(aux_layers)}".encode()] if aux_layers and keep_features else [])
      + ([] if keep_features else [b"answers only"]))).hexdigest()[:16]
    return llmc_home() / "distill" / f"{key}.safetensors"


def model_files(artifact: Path) -> dict[str, str]:
    """The sha256 of the artifact's files that decide its answers (its manifest's `files`): its weights, config and
    tokenizer, not its reports, draft or recipe."""
    files = json.loads((artifact / MANIFEST).read_text()).get("files", {})
    return {name: digest for name, digest in files.items() if name.split("/")[0] not in NOT_THE_MODEL}


def answer_tensors(token_ids: list[list[int]], hidden: list[torch.Tensor] | None, answer_starts: list[int],
                   aux: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Hidden states are stored in bfloat16, the runtime's dtype; the float32 copies hold nothing more."""
    return {
        "token_ids": torch.tensor([token for ids in token_ids for token in ids]),
        "lengths": torch.tensor([len(ids) for ids in token_ids]),
        "answer_starts": torch.tensor(answer_starts),
    } | ({"hidden": torch.cat(hidden).bfloat16()} if hidden is not None else {}) | (
        {"aux": torch.cat(aux).bfloat16()} if aux is not None else {})


def read_answers(tensors: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[torch.Tensor] | None, list[int],
                                                              list[torch.Tensor] | None]:
    """answer_tensors' columns back; aux features stay bfloat16 (three layers' of a large set would not fit as float32)."""
    lengths = tensors["lengths"].tolist()
    token_ids = [ids.tolist() for ids in tensors["token_ids"].split(lengths)]
    sizes = [length - 1 for length in lengths]
    aux = list(tensors["aux"].split(sizes)) if "aux" in tensors else None
    hidden = list(tensors["hidden"].float().split(sizes)) if "hidden" in tensors else None
    return token_ids, hidden, tensors["answer_starts"].tolist(), aux


def save_whole(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Written beside path and renamed into place: an interrupted write leaves nothing that reads as complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = unique_sibling(path)  # another run may write the same set at the same time
    save_file(tensors, partial)
    os.replace(partial, path)


def save_answers(answers: dict[int, Answer], path: Path) -> None:
    indices = sorted(answers)
    tensors = answer_tensors(*columns([answers[index] for index in indices]))
    save_whole(tensors | {"prompt_indices": torch.tensor(indices)}, path)


def load_parts(parts: Path) -> dict[int, Answer]:
    answers = {}
    for path in sorted(parts.glob("part-*.safetensors")):
        tensors = load_file(path)
        token_ids, hidden, answer_starts, aux = read_answers(tensors)
        for row, index in enumerate(tensors["prompt_indices"].tolist()):
            answers[index] = Answer(token_ids[row], None if hidden is None else hidden[row], answer_starts[row],
                                    None if aux is None else aux[row])
    return answers


def save_distill_set(data: DistillSet, path: Path) -> None:
    tensors = answer_tensors(data.token_ids, data.hidden, data.answer_starts, data.aux)
    save_whole(tensors | {"lm_head": data.lm_head.bfloat16().contiguous()}, path)


def load_distill_set(path: Path) -> DistillSet:
    tensors = load_file(path)
    token_ids, hidden, answer_starts, aux = read_answers(tensors)
    return DistillSet(token_ids, hidden, answer_starts, tensors["lm_head"].float(), aux)
