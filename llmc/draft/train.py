"""One training loop for draft heads: AdamW with warm-up and cosine decay, a progress bar, a resumable
checkpoint (weights, optimizer moments and losses in one safetensors file) and a loss-curve PNG."""
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from llmc.core.plot import saved_figure
from llmc.runtime.engine.config import native_bfloat16

CHECKPOINT = "checkpoint.safetensors"


@dataclass(slots=True)
class TrainConfig:
    steps: int = 400
    lr: float = 1e-3
    warmup: float = 0.05  # fraction of steps
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0
    # the loss computed under bfloat16 autocast (faster on a GPU and a CPU with bfloat16 matmuls, far slower on a CPU
    # without); weights and moments stay float32. None: where the device has bfloat16 matmuls
    mixed_precision: bool | None = None


def learning_rate(step: int, config: TrainConfig) -> float:
    warmup = max(1, int(config.warmup * config.steps))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    return config.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, config.steps - warmup)))


def save_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, step: int, losses: list[float]) -> None:
    tensors = {f"model.{name}": tensor.detach().cpu().contiguous() for name, tensor in module.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        tensors |= {f"optimizer.{index}.{key}": value.detach().cpu().contiguous() for key, value in state.items()}
    save_file(tensors, path, metadata={"step": str(step), "losses": json.dumps(losses)})


def load_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, list[float]]:
    from safetensors import safe_open

    tensors = load_file(path)
    with safe_open(path, "pt") as file:
        metadata = file.metadata()
    module.load_state_dict({name.removeprefix("model."): tensor for name, tensor in tensors.items() if name.startswith("model.")})
    state: dict[int, dict] = {}
    for name, tensor in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return int(metadata["step"]), json.loads(metadata["losses"])


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    with saved_figure(path) as axis:
        axis.plot(range(1, len(losses) + 1), losses, linewidth=0.8)
        axis.set(xlabel="step", ylabel="loss", title=title)


def train(module: nn.Module, loss_fn: Callable[[int], torch.Tensor], config: TrainConfig, workdir: Path, title: str,
          device: torch.device | str = "cpu") -> list[float]:
    """Minimise loss_fn(step) over module's trainable parameters, module moved to device (where loss_fn computes);
    resumes from workdir's checkpoint if there is one. Returns the loss of every step, also drawn to
    workdir/loss.png; the checkpoint is removed once done."""
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    device = torch.device(device)
    module.to(device)
    mixed_precision = native_bfloat16(str(device)) if config.mixed_precision is None else config.mixed_precision
    parameters = [parameter for parameter in module.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    checkpoint = workdir / CHECKPOINT
    start, losses = load_checkpoint(checkpoint, module, optimizer) if checkpoint.is_file() else (0, [])
    module.train()
    with tqdm(range(start, config.steps), desc=title, unit="step", initial=start, total=config.steps) as progress:
        for step in progress:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, config)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed_precision):
                loss = loss_fn(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(parameters, config.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
            if (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
                save_checkpoint(checkpoint, module, optimizer, step + 1, losses)
    module.eval()
    plot_losses(losses, workdir / "loss.png", title)
    checkpoint.unlink(missing_ok=True)
    return losses
