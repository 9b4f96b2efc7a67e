"""A draft folder inside the artifact: config.json (method, sizes, how it was trained) and heads.safetensors; an
EAGLE-3 draft also holds vllm/, the same weights in the layout vLLM loads (draft.export)."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from llmc.artifact.reader import DRAFT_DIR
from llmc.core.errors import LlmcError
from llmc.runtime.speculative.eagle import EagleDraft, EagleShape
from llmc.runtime.speculative.eagle3 import Eagle3Draft
from llmc.runtime.speculative.medusa import MedusaHeads

WEIGHTS = "heads.safetensors"


def save_heads(folder: Path, heads: nn.Module) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous() for name, tensor in heads.state_dict().items()}, folder / WEIGHTS)


def save_draft(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def read_draft_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise LlmcError(f"{folder} is not a draft folder (no config.json); train one with `llmc train-draft ARTIFACT`")
    return json.loads(path.read_text())


def load_draft(folder: Path, dtype: torch.dtype, device: str) -> tuple[dict, nn.Module]:
    config = read_draft_config(folder)
    if config.get("method") == "medusa":
        if "draft_vocab_size" not in config:
            raise LlmcError(f"{folder}: Medusa heads of an earlier llmc (no vocabulary projections); retrain them with `llmc train-draft`")
        heads = MedusaHeads(config["hidden_size"], config["num_heads"], config["draft_vocab_size"])
    elif config.get("method") == "eagle":
        heads = EagleDraft(EagleShape(**config["shape"]))
    elif config.get("method") == "eagle3":
        heads = Eagle3Draft(LlamaConfig(**config["config"]))
    else:
        raise LlmcError(f"{folder}: unknown draft method {config.get('method')!r}")
    heads.load_state_dict(load_file(folder / WEIGHTS))
    return config, heads.to(device, dtype).eval()


def draft_folder(model: str, speculative: str) -> Path | None:
    """The draft a command decodes with: `auto` is MODEL/draft when MODEL is an artifact with heads, `off` none,
    anything else the folder given."""
    if speculative == "off":
        return None
    if speculative == "auto":
        folder = Path(model) / DRAFT_DIR
        return folder if (folder / "config.json").is_file() else None
    return Path(speculative)
