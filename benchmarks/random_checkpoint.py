"""A random checkpoint in Llama-3-8B's shapes (hidden 4096, MLP 14336, 32 heads over 8 KV heads, vocabulary 128,256),
a few layers deep, with SmolLM2's tokenizer (its ids lie inside the vocabulary): what `llmc bench --ladder` and the
other whole-model commands run on where no 8B checkpoint can be fetched. Written in bfloat16, as the hub's is.

    python benchmarks/random_checkpoint.py OUT [--layers 4]
"""
import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from llmc.checkpoints.spec import resolve_model

LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    config = LlamaConfig(**LLAMA_3_8B, num_hidden_layers=args.layers, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialising billions of weights: the GPU's job
        model = LlamaForCausalLM(config)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {args.layers} layers")


if __name__ == "__main__":
    main()
