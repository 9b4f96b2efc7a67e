"""The `draft` section: which heads to train on the quantized model, on which prompts, for how long."""
from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmc.core.schema import StrictModel

# training steps: Medusa heads learn fast; EAGLE's layers see 512 tokens a step, EAGLE-3's cost more (steps=2000 is its
# smaller setting; what each costs: docs/speculative.md)
STEPS = {"medusa": 300, "eagle": 6000, "eagle3": 6000}


class DraftConfig(StrictModel):
    """Draft heads trained on the quantized model, by self-distillation on `prompts` (never the evaluation set)."""

    method: Literal["medusa", "eagle", "eagle3"] = "medusa"
    num_heads: int = Field(4, gt=0, le=8)  # Medusa heads
    # JSONL prompt files, each self-distilled and cached on its own: the project's templated requests and the
    # requests the default model itself writes, left alone and begun with an instruction's opening (two parts;
    # calib_data/README.md)
    prompts: list[str] = ["calib_data/draft_prompts.jsonl", "calib_data/sampled_prompts.jsonl",
                          "calib_data/steered_prompts.jsonl", "calib_data/steered_prompts_2.jsonl"]
    num_prompts: int | None = Field(None, gt=0)  # at most this many prompts of each file; None: all of them
    max_tokens: int = Field(128, gt=0)  # answer length generated per prompt
    steps: int | None = Field(None, gt=0)  # default: STEPS of the method
    # rows (tokens) per step, default 128; EAGLE: windows of 128 tokens, default 512; EAGLE-3: a whole sequence per
    # 128 of them (answers are 128 tokens by default)
    batch_size: int | None = Field(None, gt=0)
    lr: float = Field(1e-3, gt=0)
    unroll: int = Field(3, gt=0, le=8)  # EAGLE: drafting steps unrolled in training, each fed the previous one's guess
    # EAGLE-3: the target layers whose entering residual stream the draft fuses (0: the embeddings, num_layers: the
    # last layer's output); None: EAGLE-3's low, middle and high choice (runtime.speculative.eagle3.default_aux_layers)
    aux_layers: list[int] | None = Field(None, min_length=1)
    # EAGLE-3: the target's features stored by the distillation, or computed again by the target while training
    # (draft.features); auto: online on a GPU, stored on a CPU
    features: Literal["auto", "stored", "online"] = "auto"
    seed: int = 0

    @field_validator("prompts", mode="before")
    @classmethod
    def _one_file_or_many(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _method_defaults(self) -> "DraftConfig":
        if self.aux_layers is not None and self.method != "eagle3":
            raise ValueError(f"aux_layers: only an eagle3 draft fuses target layers, this one is {self.method}")
        if self.features == "online" and self.method != "eagle3":
            raise ValueError(f"features: only an eagle3 draft reads the target's features online, this one is {self.method}")
        self.steps = self.steps or STEPS[self.method]
        self.batch_size = self.batch_size or (128 if self.method == "medusa" else 512)
        return self
