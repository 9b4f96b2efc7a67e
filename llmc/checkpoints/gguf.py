import shutil
from pathlib import Path

import torch
from rich.console import Console

from llmc.core.staging import OutputTaken, move_into_place, unique_sibling


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint once into a float32 HF folder (safetensors), written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    Console(stderr=True).print(f"converting {gguf_path.name} into {target} (once)")
    staging = unique_sibling(target)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # transformers refuses to save a model it loaded from GGUF; a plain copy of its weights saves fine
        config = loaded.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            move_into_place(staging, target, replace=False)
        except OutputTaken:  # another run converted the same file meanwhile: its folder is as good as this one
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
