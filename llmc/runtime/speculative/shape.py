"""A draft's shape: how deep it drafts, how many tree nodes are verified, and how probable a path must be to be
verified; each method's default is the shape that decoded fastest at batch 1 on SmolLM2 (docs/benchmarks.md:
benchmarks/speculative_shapes.py)."""
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DraftShape:
    depth: int | None  # None: one level per Medusa head
    num_nodes: int  # 0: a chain
    min_confidence: float


DEFAULT_SHAPES = {"medusa": DraftShape(None, 7, 0.0), "eagle": DraftShape(4, 7, 0.3), "eagle3": DraftShape(4, 7, 0.1)}

# the chain drafts are measured at where engines or thresholds compare them (vLLM side by side, the quality gate):
# 3 tokens drafted on every step, as vLLM's EAGLE-3 examples draft
COMPARISON_CHAIN = 3
