import pytest
import torch
import torch.nn.functional as F

from llmc.quant.qtypes import QuantArgs, quantize_weight
from llmc.runtime.layers.attention import DecodeRows, ScoreShape, decode_attention_reference, prefill_attention_reference
from llmc.runtime.layers.cpu_attention import attend_rows_cpu, compiled_kernel, decode_attention_cpu
from llmc.runtime.layers.int4_amx import amx_available
from llmc.runtime.layers.linear import DenseLinear, Int4CpuLinear, Int8CpuLinear, build_linear
from llmc.runtime.layers.linear_weight import LinearWeight, merge
from llmc.runtime.layers.norm import RMSNorm
from llmc.runtime.layers.quantized_input_linear import QuantizedInputLinear
from llmc.runtime.layers.rotary import RotaryEmbedding
from llmc.runtime.layers.sampler import greedy_tokens


def quantized(out_features=96, in_features=128, symmetric=True, group_size=32, seed=0):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return quantize_weight(weight, QuantArgs(num_bits=4, symmetric=symmetric, group_size=group_size))


def test_int4_kernel_weights_equal_dequantize_bit_for_bit():
    weight = quantized()
    linear = Int4CpuLinear(LinearWeight(weight), torch.float32, "cpu")
    # multiplying by the identity reads the kernel's weights back without any summation
    assert torch.equal(linear(torch.eye(128)), weight.dequantize().t())
    x = torch.randn(5, 128)
    torch.testing.assert_close(linear(x), x @ weight.dequantize().t(), atol=1e-4, rtol=1e-4)


def test_int4_dense_copy_holds_the_kernels_weights_and_takes_steps_of_many_rows():
    weight = quantized(group_size=64)
    linear = Int4CpuLinear(LinearWeight(weight), torch.bfloat16, "cpu")
    identity = torch.eye(128, dtype=torch.bfloat16)
    kernel_weights = linear(identity).t()
    linear.use_dense_copy(weight, max_eager_rows=12)
    assert torch.equal(linear(identity).t(), kernel_weights)  # 128 rows, on the copy: the same bfloat16 weights
    few, many = torch.randn(12, 128).bfloat16(), torch.randn(13, 128).bfloat16()
    assert torch.equal(linear(few), linear.matmul(few))
    assert torch.equal(linear(many), F.linear(many, kernel_weights))
    exact = many.float() @ kernel_weights.float().t()
    torch.testing.assert_close(linear(many).float(), exact, atol=0.1, rtol=0.02)  # bfloat16 outputs of about 10


def test_kernel_choice_and_bfloat16_int4_matches_dense():
    bias = torch.randn(96)
    int4 = build_linear([LinearWeight(quantized(), bias)], torch.bfloat16, "cpu")
    assert isinstance(int4, Int4CpuLinear)
    assert isinstance(build_linear([LinearWeight(quantized())], torch.float32, "cpu"), DenseLinear)
    assert isinstance(build_linear([LinearWeight(quantized(symmetric=False))], torch.bfloat16, "cpu"), DenseLinear)
    x = torch.randn(4, 128)
    expected = F.linear(x, quantized().dequantize(), bias)
    torch.testing.assert_close(int4(x.bfloat16()).float(), expected, atol=0.15, rtol=0.02)


@pytest.mark.skipif(not amx_available(), reason="the CPU has no AMX tiles")
def test_int4_on_amx_matches_the_eager_kernel_and_each_row_gets_the_bits_it_gets_alone():
    linear = Int4CpuLinear(LinearWeight(quantized(256, 512, group_size=64), torch.randn(256)), torch.bfloat16, "cpu")
    with torch.inference_mode():  # as the engine runs it
        x = torch.randn(40, 512).bfloat16()
        eager = linear(x)
        assert linear.use_amx(max_eager_rows=0)
        together = linear(x)
        assert not torch.equal(together, eager)  # another kernel: its own summation order
        assert (together - eager).abs().max() <= 0.02 * eager.abs().max()
        assert all(torch.equal(linear(x[:rows]), together[:rows]) for rows in (1, 2, 7, 33))
        linear.max_eager_rows = 12
        assert torch.equal(linear(x[:12]), eager[:12]) and torch.equal(linear(x[:13]), together[:13])


def test_an_amx_matmul_that_disagrees_with_the_eager_kernel_stays_eager(monkeypatch, caplog):
    linear = Int4CpuLinear(LinearWeight(quantized(64, 128, group_size=64)), torch.bfloat16, "cpu")
    monkeypatch.setattr(torch, "compile", lambda function, **options: lambda x: torch.zeros(len(x), 64, dtype=x.dtype))
    assert not linear.use_amx(max_eager_rows=0) and linear.amx is None
    assert "stays on the eager kernel" in caplog.text
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(linear(x), linear.matmul(x))


def test_bfloat16_int8_channel_weights_run_their_kernel_and_each_row_gets_the_bits_it_gets_alone():
    """W8A16 (symmetric int8, one scale per output channel) in bfloat16 on torch's int8 CPU kernel. A row's result
    must not depend on the rows beside it: speculative verification's greedy identity rests on that."""
    weight = quantize_weight(torch.randn(96, 128, generator=torch.Generator().manual_seed(3)), QuantArgs(num_bits=8, strategy="channel"))
    bias = torch.randn(96)
    int8 = build_linear([LinearWeight(weight, bias)], torch.bfloat16, "cpu")
    assert isinstance(int8, Int8CpuLinear) and int8.codes.dtype == torch.int8
    assert isinstance(build_linear([LinearWeight(weight)], torch.float32, "cpu"), DenseLinear)
    asymmetric = quantize_weight(torch.randn(96, 128), QuantArgs(num_bits=8, symmetric=False, strategy="channel"))
    assert isinstance(build_linear([LinearWeight(asymmetric)], torch.bfloat16, "cpu"), DenseLinear)
    x = torch.randn(21, 128).bfloat16()
    torch.testing.assert_close(int8(x).float(), F.linear(x.float(), weight.dequantize(), bias), atol=0.1, rtol=0.02)
    together = int8(x)
    assert all(torch.equal(together[row], int8(x[row : row + 1])[0]) for row in range(len(x)))


def test_dense_weights_put_weight_only_layers_on_dense_matmuls_and_keep_quantized_activations():
    weight = quantized()
    dense = build_linear([LinearWeight(weight)], torch.bfloat16, "cpu", dense=True)
    assert isinstance(dense, DenseLinear) and torch.equal(dense.weight, weight.dequantize().bfloat16())
    x = torch.randn(64, 128).bfloat16()
    int4 = build_linear([LinearWeight(weight)], torch.bfloat16, "cpu")
    torch.testing.assert_close(dense(x).float(), int4(x).float(), atol=0.15, rtol=0.02)  # the same weights, other rounding
    w8a8 = quantize_weight(torch.randn(96, 128), QuantArgs(num_bits=8, strategy="channel"))
    w8a8.input_activations = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    assert isinstance(build_linear([LinearWeight(w8a8)], torch.bfloat16, "cpu", dense=True), QuantizedInputLinear)


def test_merged_projections_split_back_to_each_output():
    parts = [LinearWeight(quantized(32, seed=1), torch.randn(32)), LinearWeight(quantized(64, seed=2)),
             LinearWeight(torch.randn(16, 128), None)]  # mixed formats run dense
    merged = build_linear(parts, torch.float32, "cpu")
    x = torch.randn(3, 128)
    first, second, third = merged(x).split([32, 64, 16], dim=-1)
    torch.testing.assert_close(first, F.linear(x, parts[0].weight.dequantize(), parts[0].bias))
    torch.testing.assert_close(second, x @ parts[1].weight.dequantize().t())
    torch.testing.assert_close(third, x @ parts[2].weight.t())


def test_merged_input_scales_keep_the_widest_range():
    static_fp8 = QuantArgs(num_bits=8, type="float", strategy="tensor")
    nvfp4 = QuantArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16, dynamic="local", scale_dtype="float8_e4m3fn")
    for acts, widest in ((static_fp8, 0.2), (nvfp4, 2.0)):  # a larger scale, or a smaller global scale, covers more
        parts = []
        for seed, scale in ((1, 0.2 if acts is static_fp8 else 2.0), (2, 0.1 if acts is static_fp8 else 4.0)):
            weight = quantized(32, seed=seed)
            weight.input_activations = acts
            parts.append(LinearWeight(weight, None, torch.tensor([scale])))
        assert merge(parts).input_scale.item() == pytest.approx(widest)


def paged_cache(seed=0, num_blocks=12, dtype=torch.float32, num_kv_heads=2, head_dim=16):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 16, num_kv_heads, head_dim)
    return torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)


def test_paged_reference_equals_contiguous_attention():
    k_cache, v_cache = paged_cache()
    block_table = torch.tensor([7, 2, 9])
    context_len, query_len = 40, 6
    query = torch.randn(query_len, 4, 16)
    keys = k_cache[block_table].flatten(0, 1)[:context_len].repeat_interleave(2, dim=1)
    values = v_cache[block_table].flatten(0, 1)[:context_len].repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * 0.25
    positions = torch.arange(context_len - query_len, context_len)
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > positions[:, None], float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(prefill_attention_reference(query, k_cache, v_cache, block_table, context_len, 0.25), expected)
    decoded = decode_attention_reference(query[-1:], k_cache, v_cache, block_table[None], torch.tensor([context_len]), 0.25)
    torch.testing.assert_close(decoded, expected[-1:])


def test_decode_attention_of_a_sequence_does_not_depend_on_its_batch():
    """Sequences holding as many blocks are attended in one matmul; each must get the bits it gets alone."""
    k_cache, v_cache = paged_cache(num_blocks=24, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    block_tables = torch.randperm(24, generator=generator)[:20].view(5, 4)
    context_lens = torch.tensor([17, 30, 64, 3, 20])  # blocks 2, 2, 4, 1, 2
    query = torch.randn(5, 4, 16, generator=generator).bfloat16()
    together = decode_attention_reference(query, k_cache, v_cache, block_tables, context_lens, 0.25)
    for row in range(5):
        alone = decode_attention_reference(
            query[row : row + 1], k_cache, v_cache, block_tables[row : row + 1], context_lens[row : row + 1], 0.25
        )
        assert torch.equal(together[row : row + 1], alone)
        keys = k_cache[block_tables[row]].flatten(0, 1)[: context_lens[row]].float().repeat_interleave(2, dim=1)
        values = v_cache[block_tables[row]].flatten(0, 1)[: context_lens[row]].float().repeat_interleave(2, dim=1)
        expected = torch.einsum("hk,khd->hd", (torch.einsum("hd,khd->hk", query[row].float(), keys) * 0.25).softmax(-1), values)
        torch.testing.assert_close(alone[0].float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rotary_give_transformers_bits(dtype):
    """The runtime's RMSNorm and its one pass over queries and keys side by side (a strided view of the qkv
    projection's output) compute what transformers' Llama modules compute, bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(2)
    hidden = (torch.randn(7, 96, generator=generator) * 3).to(dtype)
    reference = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    reference.weight.data = torch.randn(96, generator=generator).to(dtype)
    assert torch.equal(RMSNorm(reference.weight.data, 1e-5)(hidden), reference(hidden))

    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    rotary = RotaryEmbedding(config, 64, dtype)
    qkv = torch.randn(7, 10, 16, generator=generator).to(dtype)  # 6 query heads, 2 key heads, 2 value heads
    positions = torch.tensor([0, 1, 5, 17, 30, 31, 63])
    q, k = rotary(positions, qkv[:, :8]).split([6, 2], dim=1)
    expected_q, expected_k = apply_rotary_pos_emb(
        qkv[None, :, :6].transpose(1, 2), qkv[None, :, 6:8].transpose(1, 2), rotary.cos[positions][None], rotary.sin[positions][None]
    )
    assert torch.equal(q, expected_q[0].transpose(0, 1)) and torch.equal(k, expected_k[0].transpose(0, 1))


def test_greedy_tokens_are_the_argmax_with_the_first_index_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, -1.0, 3.0, 3.0]], dtype=torch.bfloat16)
    assert greedy_tokens(logits) == [1, 0]
    generator = torch.Generator().manual_seed(0)
    many_ties = (torch.randn(64, 49152, generator=generator) * 2).round().bfloat16()
    assert greedy_tokens(many_ties) == many_ties.argmax(-1).tolist()


@pytest.mark.parametrize("shape", [ScoreShape(), ScoreShape(window=9, softcap=2.0)], ids=["plain", "window-softcap"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (8, 1, 128), (14, 2, 64)])
def test_cpu_decode_kernel_equals_the_reference_and_keeps_each_rows_bits(shape, num_heads, num_kv_heads, head_dim):
    """The C++ kernel (compiled on first use) against the torch reference in float32; in bfloat16 and float16 a row's
    bits do not depend on its batch, and reading a row by its key slots (draft rows) gives the bits reading it by
    blocks does. Head sizes 64 and 128 take the explicit AVX-512 path (query groups of 3, 8 and 7: tiles of 6 and 3
    heads and their remainders), 16 the compiler's."""
    if compiled_kernel() is None:
        pytest.skip("no C++ toolchain: the engine decodes on the reference")
    generator = torch.Generator().manual_seed(2)
    block_tables = torch.randperm(24, generator=generator)[:20].view(5, 4)
    context_lens = torch.tensor([17, 30, 64, 3, 20])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k_cache, v_cache = paged_cache(num_blocks=24, dtype=dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)
        query = torch.randn(5, num_heads, head_dim, generator=generator).to(dtype)
        scale = head_dim**-0.5
        got = decode_attention_cpu(query, k_cache, v_cache, block_tables, context_lens, scale, shape=shape)
        expected = decode_attention_reference(query, k_cache, v_cache, block_tables, context_lens, scale, shape=shape)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
        for row in range(5):
            alone = decode_attention_cpu(query[row : row + 1], k_cache, v_cache, block_tables[row : row + 1],
                                         context_lens[row : row + 1], scale, shape=shape)
            assert torch.equal(got[row : row + 1], alone)
        slots = (block_tables[:, :, None] * 16 + torch.arange(16)).flatten(1)
        by_slot = attend_rows_cpu(query, k_cache, v_cache, [DecodeRows(torch.arange(5), slots, context_lens)], scale, shape=shape)
        assert torch.equal(by_slot, got)
