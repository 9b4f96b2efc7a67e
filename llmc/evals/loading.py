"""Load any target (model spec or llmc artifact) as a dense transformers model for evaluation; an artifact's
activation and KV-cache quantization is emulated."""
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from llmc.artifact.reader import dense_state_dict, is_artifact, runtime_quantization
from llmc.checkpoints.calibration_moe import linearize_experts
from llmc.checkpoints.families import family_for
from llmc.checkpoints.spec import resolve_model
from llmc.core.errors import LlmcError
from llmc.evals.emulation import emulate_runtime_quantization


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    is_artifact: bool


def load_model(target: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoadedModel:
    """The target as a transformers model on device; evals feed it inputs on its own device."""
    path = Path(target).expanduser()
    if path.is_dir() and is_artifact(path):
        return LoadedModel(target, _load_artifact(path, dtype).to(device), AutoTokenizer.from_pretrained(path), True)
    folder = resolve_model(target)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval().to(device)
    return LoadedModel(target, model, AutoTokenizer.from_pretrained(folder), False)


def _load_artifact(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    runtime, family = runtime_quantization(folder), family_for(config)
    state = dense_state_dict(folder, dtype)
    expert_inputs = family.moe is not None and any(f".{family.moe.block}.experts." in name for name in runtime.inputs)
    if family.moe is not None and not expert_inputs:
        # transformers' own loading turns the per-expert tensors into its fused experts (the fast MoE forward)
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if expert_inputs:  # experts with quantized inputs need one Linear each to emulate them: every token runs every expert
            linearize_experts(model, family)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise LlmcError(f"artifact {folder} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.tie_weights()
    emulate_runtime_quantization(model, runtime)
    return model.eval()
