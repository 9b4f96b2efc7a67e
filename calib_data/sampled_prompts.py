"""Write user requests sampled from the default model itself, for training draft heads (the Magpie method).

    python calib_data/sampled_prompts.py             # sampled_prompts.jsonl: the model's own openings
    python calib_data/sampled_prompts.py --steered   # steered_prompts.jsonl: each request begun with an OPENINGS word
    python calib_data/sampled_prompts.py --steered 2 # steered_prompts_2.jsonl: the next STEERED_SAMPLES seeds

The chat template is rendered up to where a user's message begins and the model writes the message (sampling,
temperature 0.9, top-p 0.95, a seed per request), as an instruction-tuned model has learned what users ask. Left
alone, SmolLM2 opens most requests with "Can you ..."; the steered set begins each one with an instruction's
opening word or two (write, imagine, given, solve, ...), so the model writes the tasks, constraints and passages
that such requests carry; the steered set comes in parts of STEERED_SAMPLES seeds, a file each (each is distilled
and cached on its own). Requests that end within MAX_TOKENS, read as English and repeat no earlier one are kept.
Only prompts: the answers come from the model being served, at training time. None of it comes from MT-bench,
the evaluation set.
"""
import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from llmc.checkpoints.spec import resolve_model
from llmc.core.prompts import read_prompt_texts
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

NUM_SAMPLES = 2048
STEERED_SAMPLES = 4096
STEERED_SEED = 1_000_000  # the steered set's seeds start here: none repeats a plain sample's
MAX_TOKENS = 96
MIN_WORDS = 6
PLACEHOLDER = "\x00"
OPENINGS = [
    "Write", "Write a short", "Compose", "Draft", "Describe", "Explain", "Imagine you are", "Pretend you are",
    "Act as", "You are", "Summarize", "Rewrite", "Compare", "Solve", "Calculate", "Given", "Suppose", "If",
    "Implement", "Write a Python", "Write a function", "Create", "Design", "Plan", "List", "Give me", "Suggest",
    "Evaluate", "Analyze", "Identify", "Extract", "Read the following", "Translate", "Classify", "What", "How",
    "Why", "Which", "In", "Consider", "Help me", "Please", "I need", "Tell me", "Discuss", "Outline",
]


def user_turn_prefix(tokenizer) -> str:
    """The rendered chat up to the first character of a user's message (the default system prompt included)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False)
    return rendered[: rendered.index(PLACEHOLDER)]


def reads_as_a_request(text: str) -> bool:
    words = text.split()
    ascii_share = sum(char.isascii() for char in text) / max(1, len(text))
    longest_word = max((len(word) for word in words), default=0)
    return len(words) >= MIN_WORDS and ascii_share > 0.98 and longest_word <= 24 and "http" not in text


def sample_requests(engine: LLM, openings: list[str], first_seed: int) -> list[str]:
    """One request per opening ("" for the model's own), each with its own seed, finished ones only."""
    prefix = user_turn_prefix(engine.tokenizer)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=first_seed + index)
              for index in range(len(openings))]
    seqs = [engine.add_request(prefix + opening, param) for opening, param in zip(openings, params)]
    with tqdm(total=len(seqs), desc="the model writes user requests", unit="request") as progress:
        while engine.has_unfinished():
            progress.update(sum(output.finish_reason is not None for output in engine.step()))
    return [opening + seq.text for opening, seq in zip(openings, seqs) if seq.finish_reason == "stop"]


def output_file(steered_part: int | None) -> Path:
    name = "sampled_prompts" if steered_part is None else "steered_prompts" + (f"_{steered_part}" if steered_part > 1 else "")
    return Path(__file__).with_name(name + ".jsonl")


def earlier_requests(steered_part: int | None) -> set[str]:
    """The requests of the files written before this one (the plain set, the steered set's earlier parts)."""
    files = [output_file(part) for part in ([None] + list(range(1, steered_part)) if steered_part else [])]
    return {text for file in files if file.is_file() for text in read_prompt_texts(file)}


def main(steered_part: int | None) -> None:
    engine = LLM(resolve_model("smollm2-135m"), EngineConfig(dtype=torch.bfloat16, max_num_seqs=128))
    if steered_part:
        openings = [OPENINGS[index % len(OPENINGS)] for index in range(STEERED_SAMPLES)]
        texts = sample_requests(engine, openings, STEERED_SEED + (steered_part - 1) * STEERED_SAMPLES)
    else:
        texts = sample_requests(engine, [""] * NUM_SAMPLES, 0)
    seen = earlier_requests(steered_part)
    kept = [text for text in dict.fromkeys(text.strip() for text in texts) if reads_as_a_request(text) and text not in seen]
    output = output_file(steered_part)
    output.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in kept))
    print(f"{len(kept)} of {len(texts)} finished requests kept in {output}")


def part_number(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a part is a number from 1, not {value!r}")
    return int(value)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steered", type=part_number, nargs="?", const=1, metavar="PART",
                        help="write part PART (default 1) of the steered set instead of the plain one")
    main(parser.parse_args().steered)
