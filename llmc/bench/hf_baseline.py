"""The reference a load test is compared with: transformers `generate`, one request at a time."""
import time

import numpy as np
import torch

from llmc.bench.load import RequestResult, summarize


def hf_baseline(model: str, prompts: list[str], max_tokens: int) -> dict:
    """transformers `generate` in float32 on the same (dequantized) weights, one request at a time."""
    from transformers.generation.streamers import BaseStreamer

    from llmc.evals.loading import load_model

    loaded = load_model(model, torch.float32)

    class Timestamps(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    results, start = [], time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
        stamps, begin = Timestamps(), time.perf_counter()
        with torch.inference_mode():
            loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, streamer=stamps)
        token_times = stamps.times[1:]  # the first put() is the prompt
        results.append(RequestResult(ids.shape[1], len(token_times), token_times[0] - begin, token_times[-1] - begin,
                                     list(np.diff(token_times))))
    return summarize(results, time.perf_counter() - start)
