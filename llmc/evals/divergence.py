"""Mean KL divergence KL(base || other) of next-token distributions, over each item's chat prompt followed
by its reference continuation: how far quantization moved the model where the answer is decided."""
import torch
from tqdm import tqdm

from llmc.evals.business_set import BusinessItem
from llmc.evals.generation import chat_prompt_ids


def item_token_ids(tokenizer, item: BusinessItem) -> torch.Tensor:
    prompt = chat_prompt_ids(tokenizer, item.prompt_messages)
    continuation = tokenizer(item.reference_text, add_special_tokens=False)["input_ids"]
    return torch.tensor([prompt + continuation])


@torch.no_grad()
def mean_kl(base, other, tokenizer, items: list[BusinessItem], label: str = "KL") -> float:
    total, positions = 0.0, 0
    for item in tqdm(items, desc=label, unit="item"):
        input_ids = item_token_ids(tokenizer, item).to(base.device)
        base_logprobs = torch.log_softmax(base(input_ids).logits[0].float(), dim=-1)
        other_logprobs = torch.log_softmax(other(input_ids.to(other.device)).logits[0].float().to(base.device), dim=-1)
        total += (base_logprobs.exp() * (base_logprobs - other_logprobs)).sum().item()
        positions += input_ids.shape[1]
    return total / positions
