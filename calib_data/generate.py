"""Regenerate calib_data/smollm2_self_generated.jsonl: the project's own prompts answered by SmolLM2 itself.

    python calib_data/generate.py            # about 10 minutes on 2 CPU cores
"""
import itertools
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmc.checkpoints.spec import resolve_model

TOPICS = [
    "photosynthesis", "the French Revolution", "compound interest", "volcanoes", "the immune system",
    "machine learning", "the water cycle", "ancient Rome", "climate change", "the stock market",
    "black holes", "healthy sleep", "the printing press", "electric cars", "honeybees", "the Internet",
    "chess openings", "baking bread", "the Silk Road", "plate tectonics", "vaccines", "jazz music",
    "renewable energy", "the human brain", "coral reefs", "supply and demand", "the Moon landing",
    "recycling plastics", "Shakespeare's plays", "bicycles", "the Olympic Games", "prime numbers",
]
TASKS = [
    "Explain {topic} to a curious twelve-year-old.",
    "Write a short essay about {topic}.",
    "What are three common misconceptions about {topic}?",
    "Give me a step-by-step summary of how {topic} works or developed.",
]
NUM_NEW_TOKENS = 320
BATCH_SIZE = 16


def main() -> None:
    torch.manual_seed(0)
    folder = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [task.format(topic=topic) for topic, task in itertools.product(TOPICS, TASKS)]
    output = Path(__file__).with_name("smollm2_self_generated.jsonl")
    with open(output, "w") as file:
        for start in range(0, len(prompts), BATCH_SIZE):
            batch = prompts[start : start + BATCH_SIZE]
            chats = [[{"role": "user", "content": prompt}] for prompt in batch]
            texts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                generated = model.generate(
                    **inputs, max_new_tokens=NUM_NEW_TOKENS, do_sample=True, temperature=0.8, top_p=0.95
                )
            answers = tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            for prompt, answer in zip(batch, answers):
                messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer.strip()}]
                file.write(json.dumps({"messages": messages, "text": f"{prompt}\n\n{answer.strip()}"}) + "\n")
            print(f"{start + len(batch)}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
