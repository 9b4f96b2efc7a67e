"""Greedy chat generation, and choosing among options, behind one small interface, so the runtime engine can
replace transformers by changing `make_generator` alone."""
from dataclasses import dataclass
from typing import Protocol

import torch

from llmc.core.errors import LlmcError
from llmc.evals.loading import LoadedModel


@dataclass
class GenerationRequest:
    messages: list[dict]
    max_tokens: int


class Generator(Protocol):
    def generate(self, requests: list[GenerationRequest]) -> list[str]:
        """Greedy completions of each chat, rendered with the model's chat template."""

    def choose(self, messages: list[dict], options: list[str]) -> int:
        """The option the model finds likeliest as its reply (mean log-probability per token): greedy
        decoding restricted to the options."""


class TransformersGenerator:
    """One left-padded batch through `model.generate`."""

    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        configured = self.model.generation_config.eos_token_id
        self.stops = {self.tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])}

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> list[str]:
        prompts = [chat_prompt_ids(self.tokenizer, request.messages) for request in requests]
        width = max(len(prompt) for prompt in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.model.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        generated = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
            max_new_tokens=max(request.max_tokens for request in requests), pad_token_id=pad,
        )[:, width:]
        return [self._decode(tokens[: request.max_tokens].tolist()) for tokens, request in zip(generated, requests)]

    @torch.no_grad()
    def choose(self, messages: list[dict], options: list[str]) -> int:
        prompt = chat_prompt_ids(self.tokenizer, messages)
        replies = [self.tokenizer(option, add_special_tokens=False)["input_ids"] for option in options]
        width = len(prompt) + max(len(reply) for reply in replies)
        pad = self.tokenizer.pad_token_id
        rows = [prompt + reply + [pad] * (width - len(prompt) - len(reply)) for reply in replies]
        input_ids = torch.tensor(rows, device=self.model.device)
        logprobs = torch.log_softmax(self.model(input_ids).logits[:, len(prompt) - 1 : -1].float(), dim=-1).cpu()
        scores = [
            logprobs[row, torch.arange(len(reply)), torch.tensor(reply)].mean().item()
            for row, reply in enumerate(replies)
        ]
        return max(range(len(options)), key=scores.__getitem__)

    def _decode(self, tokens: list[int]) -> str:
        end = next((i for i, token in enumerate(tokens) if token in self.stops), len(tokens))
        return self.tokenizer.decode(tokens[:end], skip_special_tokens=True).strip()


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    if not tokenizer.chat_template:
        raise LlmcError(f"{tokenizer.name_or_path}: the tokenizer has no chat template, which business evals need")
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def make_generator(loaded: LoadedModel) -> Generator:
    return TransformersGenerator(loaded)
