"""One forward for the Llama family (Llama, Mistral, Qwen2), built from config.json and the artifact's tensors."""
import torch
import torch.nn.functional as F
from torch import nn

from llmc.runtime.layers.attention import AttentionMetadata, PagedAttention
from llmc.runtime.layers.linear import DenseLinear
from llmc.runtime.layers.linear_weight import LinearWeight
from llmc.runtime.layers.norm import RMSNorm
from llmc.runtime.layers.rotary import RotaryEmbedding
from llmc.runtime.models.loader import WeightLoader


class LlamaAttention(nn.Module):
    def __init__(self, config, prefix: str, weights: WeightLoader, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.qkv_proj = weights.linear([f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        self.o_proj = weights.linear([f"{prefix}.o_proj"])
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        kv_scales = weights.kv_scales(prefix, self.num_kv_heads)
        if kv_scales is not None:
            self.attn.k_scale, self.attn.v_scale = kv_scales

    def project(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of each token: [tokens, heads, head_dim]."""
        qkv = self.qkv_proj(hidden).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, qkv[:, : self.num_heads + self.num_kv_heads]).split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, qkv[:, self.num_heads + self.num_kv_heads :]


class LlamaMLP(nn.Module):
    def __init__(self, prefix: str, weights: WeightLoader):
        super().__init__()
        self.gate_up_proj = weights.linear([f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = weights.linear([f"{prefix}.down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, prefix: str, weights: WeightLoader, rotary: RotaryEmbedding):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(weights.tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", weights, rotary)
        self.post_attention_layernorm = RMSNorm(weights.tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = LlamaMLP(f"{prefix}.mlp", weights)

    # the layer in three pieces: the two around the paged attention have static shapes but the number of tokens, so
    # they are what torch.compile compiles (engine/compiled.py); the attention reads the cache by each step's lengths
    def attention_inputs(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(positions, self.input_layernorm(hidden))

    def attention_output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn.o_proj(attended.flatten(1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.attention_inputs(positions, hidden)
        return self.attention_output(hidden, self.self_attn.attn(q, k, v, metadata))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, weights: WeightLoader, max_position: int):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_position, weights.dtype).to(weights.device)
        self.embed_tokens = nn.Parameter(weights.tensor("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, f"model.layers.{index}", weights, rotary) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(weights.tensor("model.norm.weight"), config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = DenseLinear(LinearWeight(self.embed_tokens.data), weights.dtype, weights.device)
        else:
            self.lm_head = weights.linear(["lm_head"])

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            hidden = layer(positions, hidden, metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
