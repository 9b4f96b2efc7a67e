"""Write calib_data/sampled_prompts.jsonl: user requests sampled from the default model itself, for training draft heads.

    python calib_data/sampled_prompts.py            # about 14 minutes on 2 CPU cores

The chat template is rendered up to where a user's message begins and the model writes the message (sampling,
temperature 0.9, top-p 0.95, a seed per request), as an instruction-tuned model has learned what users ask (the
Magpie method). Requests that end within MAX_TOKENS, read as English and are not repeats are kept. They cover what
the model's users ask far more widely than templates can. Only prompts: the answers come from the model being
served, at training time. None of it comes from MT-bench, the evaluation set.
"""
import json
from pathlib import Path

import torch
from tqdm import tqdm

from llmc.models.spec import resolve_model
from llmc.runtime.config import EngineConfig
from llmc.runtime.engine import LLMEngine
from llmc.runtime.sampling_params import SamplingParams

NUM_SAMPLES = 2048
MAX_TOKENS = 96
MIN_WORDS = 6
PLACEHOLDER = "\x00"


def user_turn_prefix(tokenizer) -> str:
    """The rendered chat up to the first character of a user's message (the default system prompt included)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False)
    return rendered[: rendered.index(PLACEHOLDER)]


def reads_as_a_request(text: str) -> bool:
    words = text.split()
    ascii_share = sum(char.isascii() for char in text) / max(1, len(text))
    longest_word = max((len(word) for word in words), default=0)
    return len(words) >= MIN_WORDS and ascii_share > 0.98 and longest_word <= 24 and "http" not in text


def main() -> None:
    engine = LLMEngine(resolve_model("smollm2-135m"), EngineConfig(dtype=torch.bfloat16))
    prefix = user_turn_prefix(engine.tokenizer)
    seqs = [
        engine.add_request(prefix, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=seed))
        for seed in range(NUM_SAMPLES)
    ]
    with tqdm(total=NUM_SAMPLES, desc="the model writes user requests", unit="request") as progress:
        while engine.has_unfinished():
            progress.update(sum(output.finish_reason is not None for output in engine.step()))
    texts = [seq.text.strip() for seq in seqs if seq.finish_reason == "stop"]
    kept = [text for text in dict.fromkeys(texts) if reads_as_a_request(text)]
    output = Path(__file__).with_name("sampled_prompts.jsonl")
    output.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in kept))
    print(f"{len(kept)} of {NUM_SAMPLES} requests kept in {output}")


if __name__ == "__main__":
    main()
