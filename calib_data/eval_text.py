"""Regenerate calib_data/smollm2_eval_text.txt: held-out text for perplexity, written by the default model itself on
topics and requests that the calibration set does not use, so the quick start measures perplexity offline.

    python calib_data/eval_text.py            # a few minutes on 2 CPU cores
"""
import itertools
from pathlib import Path

import torch

from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

TOPICS = [
    "glaciers", "the Roman aqueducts", "tides", "bird migration", "paper money", "the telescope", "tea",
    "earthquakes", "the periodic table", "rainforests", "the violin", "public libraries", "antibiotics",
    "the steam engine", "deserts", "lighthouses", "the alphabet", "mushrooms", "satellites", "clocks",
    "the Great Wall of China", "octopuses", "windmills", "the piano",
]
REQUESTS = [
    "Describe {topic} for an encyclopedia entry.",
    "Tell the history of {topic} in a few paragraphs.",
    "Why does {topic} matter? Answer in a short article.",
    "Write a magazine feature about {topic}.",
]
MAX_TOKENS = 384
SEED = 1


def main() -> None:
    engine = LLM("smollm2-135m", EngineConfig(dtype=torch.float32, max_num_seqs=32, enable_prefix_caching=False))
    requests = [request.format(topic=topic) for topic, request in itertools.product(TOPICS, REQUESTS)]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                                    add_generation_prompt=True) for request in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=SEED + index) for index in range(len(prompts))]
    answers = [output["text"] for output in engine.generate(prompts, params)]
    documents = [f"{request}\n\n{answer.strip()}" for request, answer in zip(requests, answers)]
    Path(__file__).with_name("smollm2_eval_text.txt").write_text("\n\n\n".join(documents) + "\n")


if __name__ == "__main__":
    main()
