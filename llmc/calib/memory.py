"""The memory preflight: peak host and device memory of a layer-by-layer run, estimated from the model's config
and the recipe before any weight is read, and a run that cannot fit refused with what to lower."""
import os
from dataclasses import asdict, dataclass, field

import torch

from llmc.checkpoints.families import family_for
from llmc.core.errors import LlmcError

GIB = 2**30
FLOAT32 = 4
PROCESS_BYTES = 0.55 * GIB  # python, torch, transformers and llmc imported, before any tensor
RUNNER_BATCH = 8  # samples per forward (LayerRunner's default)
GPTQ_SOLVE_COPIES = 7  # square float32 matrices alive at once while solving the widest input: sums, H, H + λI, L, L⁻¹, U, I
GPTQ_STACKED_COPIES = 3  # the gate/up weights stacked for one solve, its float32 working copy, that copy in act-order
# a layer's inputs, its reference outputs, and its new outputs twice while their batches are concatenated
ACTIVATION_COPIES = 4
AUTOROUND_BATCH = 8  # samples per step (the stage's default batch_size)
AUTOROUND_BATCH_COPIES = 12  # per token, the widest-width tensors a decoder layer's backward pass keeps


@dataclass
class LayerShapes:
    hidden: int
    intermediate: int
    attention_width: int  # num_heads x head_dim
    kv_width: int  # num_kv_heads x head_dim
    vocab: int
    experts: int = 1  # a MoE layer's experts (intermediate: one expert's width), each of which calibration runs on every token

    @classmethod
    def of(cls, config) -> "LayerShapes":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shapes = cls(config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim,
                     config.num_key_value_heads * head_dim, config.vocab_size)
        moe = family_for(config).moe
        if moe is not None and moe.num_experts(config) > 0:  # sparse layers outweigh a Qwen3-MoE's dense ones
            shapes.intermediate, shapes.experts = moe.expert_width(config), moe.num_experts(config)
        return shapes

    @property
    def layer_params(self) -> int:
        attention = self.hidden * (self.attention_width + 2 * self.kv_width) + self.attention_width * self.hidden
        router = self.hidden * self.experts if self.experts > 1 else 0
        return attention + 3 * self.hidden * self.intermediate * self.experts + router


@dataclass
class MemoryEstimate:
    """GiB. host: the process's peak resident memory; device: peak allocated on a CUDA device (None on CPU)."""

    host_gib: float
    device_gib: float | None
    parts_gib: dict[str, float] = field(default_factory=dict)  # what the peak is made of, where it lives

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {value:.2f}" for name, value in self.parts_gib.items())
        device = "" if self.device_gib is None else f", device {self.device_gib:.2f} GiB"
        return f"memory estimate: host {self.host_gib:.2f} GiB{device} ({parts})"


def activations_fit_device(num_bytes: int, device: torch.device) -> bool:
    """Whether the calibration activations stay on a CUDA device between layers: when two copies of them (a layer's
    inputs and outputs) take at most a quarter of its free memory. Otherwise they wait in pinned host memory."""
    return device.type == "cuda" and 2 * num_bytes <= torch.cuda.mem_get_info(device)[0] / 4


def estimate_memory(config, stage_types: list[str], num_samples: int, seq_len: int, device: torch.device) -> MemoryEstimate:
    """The largest of the run's footprints: the layer loop's (one float32 layer, the calibration activations, one
    batch's intermediates, the stages' statistics: GPTQ's Hessians per distinct input and its solve of the widest one,
    AWQ's recorded block inputs, AutoRound's streams, weight copies and backward pass), embedding the calibration set,
    and writing the embedding and LM head at the end."""
    shapes = LayerShapes.of(config)
    tokens = num_samples * seq_len
    activations_on_device = activations_fit_device(tokens * shapes.hidden * FLOAT32, device)
    parts = {
        "layer weights": shapes.layer_params * FLOAT32,
        "activations": ACTIVATION_COPIES * tokens * shapes.hidden * FLOAT32,
        # gate, up and their product; a MoE layer keeps each expert's product until its down projection runs
        "batch intermediates": (shapes.experts + 2) * min(RUNNER_BATCH, num_samples) * seq_len * shapes.intermediate * FLOAT32
        if tokens else 0,
        "statistics": _statistics_bytes(shapes, stage_types, tokens, max(seq_len, 1)),
    }
    stored = shapes.vocab * shapes.hidden * checkpoint_bytes(config)
    embedding = shapes.vocab * shapes.hidden * FLOAT32 + stored  # embedding the calibration set: a float32 copy of the table
    written = stored * (1 if getattr(config, "tie_word_embeddings", False) else 2)  # the embedding and LM head, written last
    if device.type != "cuda":
        host = PROCESS_BYTES + max(sum(parts.values()), embedding + parts["activations"] / ACTIVATION_COPIES, written)
        return MemoryEstimate(round(host / GIB, 2), None, {name: round(value / GIB, 2) for name, value in parts.items()})
    on_device = parts["layer weights"] + parts["batch intermediates"] + parts["statistics"]
    on_device += parts["activations"] if activations_on_device else 0
    host = PROCESS_BYTES + max(embedding, written, 0 if activations_on_device else parts["activations"]) + parts["layer weights"]
    return MemoryEstimate(round(host / GIB, 2), round(on_device / GIB, 2), {name: round(value / GIB, 2) for name, value in parts.items()})


def checkpoint_bytes(config) -> int:
    """Bytes per parameter as the checkpoint stores them (its config's dtype; float32 when it names none)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def _statistics_bytes(shapes: LayerShapes, stage_types: list[str], tokens: int, seq_len: int) -> int:
    widest = max(shapes.hidden, shapes.attention_width, shapes.intermediate)
    total = 0
    if "gptq" in stage_types:
        # q/k/v share one, every expert's gate/up another, o its own, and every expert's down but the solved one
        hessians = 2 * shapes.hidden**2 + shapes.attention_width**2 + (shapes.experts - 1) * shapes.intermediate**2
        # a MoE layer's gate/up of every expert solve as one stacked weight (a dense layer's stack is small beside its solve)
        stacked_gate_up = GPTQ_STACKED_COPIES * 2 * shapes.experts * shapes.intermediate * shapes.hidden if shapes.experts > 1 else 0
        total += (hessians + GPTQ_SOLVE_COPIES * widest**2 + stacked_gate_up) * FLOAT32
    if "awq" in stage_types:  # every block's inputs, kept until the layer's scales are searched
        total += tokens * (2 * shapes.hidden + shapes.attention_width + shapes.experts * shapes.intermediate) * FLOAT32
    if "autoround" in stage_types:
        # the layer's inputs, the full-precision stream and its targets; per weight its offsets, their gradient, the
        # best step's copy and the fake-quantized weight; a batch's activations kept for the backward pass
        total += 3 * tokens * shapes.hidden * FLOAT32 + 4 * shapes.layer_params * FLOAT32
        total += AUTOROUND_BATCH_COPIES * min(AUTOROUND_BATCH, tokens // seq_len) * seq_len * widest * FLOAT32
    return total


def available_host_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def require_fits(estimate: MemoryEstimate, device: torch.device, processes_on_host: int = 1) -> None:
    """One error naming what to lower when the estimate exceeds what the host (or the device) has free.
    processes_on_host: ranks sharing this host's memory, each needing the estimate."""
    largest = max(estimate.parts_gib, key=estimate.parts_gib.get)
    advice = {"activations": "calibration.num_samples or calibration.seq_len",
              "batch intermediates": "calibration.seq_len",
              "statistics": "calibration.num_samples (AWQ keeps its inputs) or use a device with more memory",
              "layer weights": "nothing in the recipe: use a machine with more memory"}[largest]
    host_free = available_host_bytes() / GIB
    if estimate.host_gib * processes_on_host > host_free:
        ranks = f" in each of {processes_on_host} processes" if processes_on_host > 1 else ""
        raise LlmcError(f"{estimate.describe()}{ranks} needs more than the {host_free:.1f} GiB of host memory available; "
                        f"the largest part is {largest}: lower {advice}")
    if estimate.device_gib is not None:
        device_free = torch.cuda.mem_get_info(device)[0] / GIB
        if estimate.device_gib > device_free:
            raise LlmcError(f"{estimate.describe()} needs more than the {device_free:.1f} GiB free on {device}; "
                            f"the largest part is {largest}: lower {advice}")
