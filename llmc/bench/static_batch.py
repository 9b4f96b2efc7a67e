"""The ladder's first rung: transformers `generate` served the way a plain deployment serves it, in static batches.
Requests queue as they arrive; when the model is free it takes up to `max_batch_size` of the waiting ones, left-pads
them and generates until every one has its tokens; requests that arrive meanwhile wait for the next batch."""
import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
from transformers import AutoConfig
from transformers.generation.streamers import BaseStreamer

from llmc.bench.model_memory import resident_bytes
from llmc.checkpoints.spec import resolve_model
from llmc.evals.loading import load_model


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue  # one None when the request is done, an exception if generate failed


class _StepClock(BaseStreamer):
    """Hands each request of the batch one token per generate step, up to its max_tokens (the first put() is the
    prompt)."""

    def __init__(self, requests: list[_Request]):
        self.requests, self.steps = requests, -1

    def put(self, value) -> None:
        self.steps += 1
        for request in self.requests:
            if 0 < self.steps <= request.max_tokens:
                request.loop.call_soon_threadsafe(request.tokens.put_nowait, 1)

    def end(self) -> None:
        pass


def model_dtype(model: str) -> torch.dtype:
    """The dtype the checkpoint declares (float32 when it declares none)."""
    config = AutoConfig.from_pretrained(resolve_model(model))
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, declared) if isinstance(declared, str) else declared


class StaticBatchServer:
    """A worker thread running transformers `generate` over static batches; `stream` is load.run_load's stream."""

    def __init__(self, model: str, max_batch_size: int, device: str = "cpu", dtype: torch.dtype | None = None):
        self.dtype = dtype or model_dtype(model)
        self.loaded = load_model(model, self.dtype, device)
        self.device = device
        self.tokenizer = self.loaded.tokenizer
        self.max_batch_size = max_batch_size
        config = self.loaded.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
                                   * torch.finfo(self.dtype).bits // 8)
        self.peak_kv_bytes = 0
        self.waiting: queue.Queue[_Request | None] = queue.Queue()
        self.worker: threading.Thread | None = None

    @property
    def weight_bytes(self) -> int:
        return resident_bytes(self.loaded.model)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def start(self) -> None:
        self.worker = threading.Thread(target=self._serve, name="static-batches", daemon=True)
        self.worker.start()

    def stop(self) -> None:
        if self.worker is not None:
            self.waiting.put(None)
            self.worker.join()
            self.worker = None

    async def stream(self, prompt: str, max_tokens: int) -> AsyncIterator[int]:
        request = _Request(self.tokenize(prompt), max_tokens, asyncio.get_running_loop(), asyncio.Queue())
        self.waiting.put(request)
        while (item := await request.tokens.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _serve(self) -> None:
        while (first := self.waiting.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch_size:
                try:
                    request = self.waiting.get_nowait()
                except queue.Empty:
                    break
                if request is None:
                    self.waiting.put(None)
                    break
                batch.append(request)
            try:
                self._generate(batch)
            except Exception as error:  # the batch's requests end with it; the server goes on
                for request in batch:
                    request.loop.call_soon_threadsafe(request.tokens.put_nowait, error)
                continue
            for request in batch:
                request.loop.call_soon_threadsafe(request.tokens.put_nowait, None)

    @torch.inference_mode()
    def _generate(self, batch: list[_Request]) -> None:
        longest = max(len(request.ids) for request in batch)
        max_tokens = max(request.max_tokens for request in batch)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids = torch.tensor([[pad] * (longest - len(r.ids)) + r.ids for r in batch], device=self.device)
        mask = torch.tensor([[0] * (longest - len(r.ids)) + [1] * len(r.ids) for r in batch], device=self.device)
        self.peak_kv_bytes = max(self.peak_kv_bytes, len(batch) * (longest + max_tokens) * self.kv_bytes_per_token)
        self.loaded.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   do_sample=False, pad_token_id=pad, streamer=_StepClock(batch))
