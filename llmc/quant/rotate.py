"""Rotations fused into the weights (QuaRot, SpinQuant's R1 and R2): orthogonal changes of basis that leave the
full-precision model's function unchanged but spread activation and weight outliers over every channel, so that
4- and 8-bit weights and activations quantized afterwards lose less.

- R1, the residual stream: every tensor that writes the stream (the embeddings, each layer's attention output and MLP
  down projections) is multiplied by R1 on its output side, every Linear that reads it (q/k/v, gate/up, the LM head)
  by R1 on its input side. RMSNorm commutes with a rotation only without its gain, so each norm's gain is first
  folded into the Linears it feeds and set to one. Families whose norms also scale what a block writes into the stream
  (Gemma's sandwich norms) cannot take R1. A model with tied embeddings gets its LM head untied: the embeddings
  are rotated alone, the head takes the final norm's gain too.
- R2, per attention head: v_proj's output rows of each head and o_proj's input columns of each head, by one
  head_dim x head_dim rotation.

Both are random Hadamard matrices (quant/hadamard.py). The rotation happens as the checkpoint is read
(`RotatedCheckpoint`), so the calibration's embeddings, every layer and the artifact's other tensors all see the
rotated model, and the artifact is a plain checkpoint any engine serves."""
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.core.errors import LlmcError
from llmc.core.schema import StrictModel
from llmc.quant.hadamard import random_rotation
from llmc.quant.layer import LayerWork
from llmc.quant.qtypes import QuantizedWeight
from llmc.quant.stage import StageRole, StageRun, register_stage

Rotation = Literal["R1", "R2"]


class RotateStage(StrictModel):
    """Hadamard rotations fused into the weights before the stages that quantize; changes no function."""

    type: Literal["rotate"]
    rotations: list[Rotation] = Field(["R1", "R2"], min_length=1)
    seed: int = 0  # the random signs of the Hadamard matrices
    needs_calibration: ClassVar[bool] = False
    rewrites_source: ClassVar[bool] = True  # applied as the checkpoint is read: it has to be the first stage


@dataclass
class LayerRoles:
    """What each rotation does to one decoder layer's tensors, by their names under the layer."""

    readers: dict[str, str] = field(default_factory=dict)  # Linear reading the residual stream -> the norm before it
    writers: list[str] = field(default_factory=list)  # Linears writing into the residual stream
    values: tuple[str, slice] | None = None  # the Linear whose output rows hold v, and those rows
    output: str | None = None  # the attention's output Linear


class RotationPlan:
    """The rotations of one model, and which of its tensors each one touches."""

    def __init__(self, config, family, skeleton: nn.Module, rotations: list[Rotation], seed: int):
        self.config, self.family = config, family
        self.r1 = random_rotation(config.hidden_size, seed).float() if "R1" in rotations else None
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.r2 = random_rotation(self.head_dim, seed + 1).float() if "R2" in rotations else None
        if self.r1 is not None and family.sandwich_norms:
            raise LlmcError(f"rotate: R1 cannot be fused into {config.model_type}: its norms also scale what each block "
                            "writes into the residual stream; use rotations: [R2]")
        self.layers = [self._roles(layer) for layer in skeleton.get_submodule(family.layers)]
        self.untie = self.r1 is not None and bool(getattr(config, "tie_word_embeddings", False))

    def _roles(self, layer: nn.Module) -> LayerRoles:
        modules = dict(layer.named_modules())
        roles = LayerRoles()
        if self.r1 is not None:
            for pair in self.family.scaling_pairs:
                if pair.smooth in modules and not isinstance(modules[pair.smooth], nn.Linear):
                    roles.readers |= {name: pair.smooth for name in (*pair.balance, *pair.also_scaled) if name in modules}
            hidden = self.config.hidden_size
            for name, module in modules.items():
                if isinstance(module, nn.Linear) and name not in roles.readers:
                    if module.out_features == hidden:
                        roles.writers.append(name)
                    elif module.in_features == hidden:
                        raise LlmcError(f"rotate: {name} reads the residual stream after no norm llmc knows; R1 cannot "
                                        f"be fused into {self.config.model_type}")
        if self.r2 is not None:
            kv_rows = self.config.num_key_value_heads * self.head_dim
            qkv = self.family.qkv
            if len(qkv) == 3:
                roles.values = (qkv[2], slice(0, kv_rows))
            else:  # one stored Linear holds q, k and v, v last
                rows = modules[qkv[0]].out_features
                roles.values = (qkv[0], slice(rows - kv_rows, rows))
            roles.output = self.family.attention_output
        return roles

    def sources(self, name: str) -> list[str]:
        """The checkpoint tensors the rotated `name` is computed from."""
        family = self.family
        if name == f"{family.lm_head}.weight":
            head = name if not self.untie else f"{family.embed_tokens}.weight"
            return [head, f"{family.final_norm}.weight"] if self.r1 is not None else [head]
        located = self._locate(name)
        if located and located[1] in self.layers[located[0]].readers and name.endswith(".weight"):
            index, leaf = located
            return [name, f"{family.layers}.{index}.{self.layers[index].readers[leaf]}.weight"]
        return [name]

    def _locate(self, name: str) -> tuple[int, str] | None:
        """(layer index, module name under the layer) of a decoder layer's tensor; None for any other tensor."""
        start = f"{self.family.layers}."
        if not name.startswith(start):
            return None
        index, _, rest = name.removeprefix(start).partition(".")
        return int(index), rest.rpartition(".")[0]

    def gain(self, weight: torch.Tensor) -> torch.Tensor:
        return self.family.norm_offset + weight.float()

    def rotated(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        family, r1, r2 = self.family, self.r1, self.r2
        source = tensors[self.sources(name)[0]]
        if name == f"{family.lm_head}.weight":
            return source if r1 is None else (source.float() * self.gain(tensors[f"{family.final_norm}.weight"])) @ r1
        if name == f"{family.embed_tokens}.weight":
            return source if r1 is None else source.float() @ r1
        if name == f"{family.final_norm}.weight" and r1 is not None:
            return self.unit_gain(source)
        located = self._locate(name)
        if located is None:
            return source
        roles, leaf, kind = self.layers[located[0]], located[1], name.rpartition(".")[2]
        if kind == "weight" and leaf in roles.readers.values():
            return self.unit_gain(source)
        tensor = source.float()
        if kind == "weight" and leaf in roles.readers:
            tensor = (tensor * self.gain(tensors[self.sources(name)[1]])) @ r1
        if leaf in roles.writers:
            tensor = r1.T @ tensor if kind == "weight" else tensor @ r1
        if roles.values and leaf == roles.values[0]:
            rows = roles.values[1]
            heads = tensor[rows].reshape(-1, self.head_dim, *tensor.shape[1:])  # [kv heads, head_dim, (in)]
            tensor = tensor.clone()
            tensor[rows] = torch.einsum("de,kd...->ke...", r2, heads).reshape(tensor[rows].shape)
        if kind == "weight" and leaf == roles.output:
            tensor = (tensor.reshape(tensor.shape[0], -1, self.head_dim) @ r2).reshape(tensor.shape)
        return tensor

    def unit_gain(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm weight whose gain is one, the gain having been folded into the Linears it feeds."""
        return torch.full_like(weight, 1 - self.family.norm_offset)


class RotatedCheckpoint(CheckpointReader):
    """A checkpoint read with the rotations applied; an untied LM head appears as a tensor of its own."""

    def __init__(self, base: CheckpointReader, plan: RotationPlan):
        self.base, self.plan = base, plan
        self.folder, self.file_of = base.folder, dict(base.file_of)
        head = f"{plan.family.lm_head}.weight"
        if plan.untie and head not in self.file_of:
            self.file_of[head] = self.file_of[f"{plan.family.embed_tokens}.weight"]

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        needed = sorted({source for name in names for source in self.plan.sources(name)})
        tensors = self.base.tensors(needed)
        return {name: self.plan.rotated(name, tensors) for name in names}


class RotateRun(StageRun):
    config: RotateStage

    def source(self, reader: CheckpointReader, skeleton: nn.Module, config) -> CheckpointReader:
        self.plan = RotationPlan(config, self.family, skeleton, self.config.rotations, self.config.seed)
        return RotatedCheckpoint(reader, self.plan)

    def config_changes(self, config) -> dict:
        return {"tie_word_embeddings": False} if self.plan.untie else {}

    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        return {}  # the layer comes rotated from the checkpoint's reader


register_stage(RotateStage, RotateRun, StageRole.TRANSFORM)
