"""`llmc export-draft`: a draft folder in the layout vLLM loads as a speculative model (`--speculative-config
'{"method": "eagle3", "model": ARTIFACT/draft/vllm}'`). Train-draft writes it beside the heads."""
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from llmc.core.errors import LlmcError
from llmc.core.staging import move_into_place, unique_sibling
from llmc.runtime.speculative.store import WEIGHTS, read_draft_config

VLLM_DIR = "vllm"
VLLM_METHODS = {"eagle3": "eagle3"}  # llmc's draft method -> vLLM's speculative method
# why vLLM cannot serve the others as they are
NOT_EXPORTABLE = {
    "eagle": "vLLM's EAGLE-1 layer has no fc bias and reads [embedding; feature], llmc's EAGLE layer has a bias; "
             "train an eagle3 draft (`--set method=eagle3`), which vLLM serves",
    "medusa": "vLLM sizes each Medusa head at the whole vocabulary (a smaller one only through its token_map) and llmc's "
              "heads cover the draft vocabulary, so llmc writes no vLLM Medusa layout; train an eagle3 draft "
              "(`--set method=eagle3`), which vLLM serves",
}


def export_for_vllm(folder: Path, out: Path) -> Path:
    """The draft in `folder` written to `out` (config.json, model.safetensors in bfloat16), staged and renamed."""
    config = read_draft_config(folder)
    method = config.get("method")
    if method not in VLLM_METHODS:
        raise LlmcError(f"{folder}: a {method} draft does not export to vLLM: {NOT_EXPORTABLE.get(method, 'unknown method')}")
    staging = unique_sibling(out)
    staging.mkdir(parents=True)
    try:
        LlamaConfig(**config["config"]).to_json_file(staging / "config.json")
        tensors = {name: tensor.bfloat16() if tensor.is_floating_point() else tensor
                   for name, tensor in load_file(folder / WEIGHTS).items()}
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, staging / "model.safetensors")
        move_into_place(staging, out, replace=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
