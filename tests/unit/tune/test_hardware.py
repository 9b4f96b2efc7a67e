"""A unit's cost on each objective: bytes as compressed-tensors stores them, kernels timed here once per shape and
format, a GPU's bandwidth model and the formats vLLM has no kernel for there."""
import torch

from llmc.artifact.compressed_tensors import compressed_tensors_tensors
from llmc.quant.qtypes import QuantArgs
from llmc.tune.hardware import GPUS, gpu_refusal
from llmc.tune.sensitivity import CostMeter, Objective, quantized_unit

W4 = QuantArgs(num_bits=4, strategy="group", group_size=32)


def test_bytes_are_the_stored_tensors_and_a_gpu_reads_them_at_its_bandwidth():
    weights = [torch.randn(96, 64), torch.randn(32, 64)]
    quantized = quantized_unit(weights, W4, torch.bfloat16)
    names = ["q_proj", "k_proj"]
    stored = sum(tensor.numel() * tensor.element_size() for name, weight in zip(names, quantized)
                 for tensor in compressed_tensors_tensors(name, weight).values())
    assert stored == 128 * 64 // 2 + 128 * 2 * 2 + 2 * 2 * 8  # codes, bfloat16 scales, two int64 shapes
    assert CostMeter(Objective("smallest"))(names, "W4", quantized, None) == stored
    assert CostMeter(Objective("smallest"))(names, "keep", weights, None) == 128 * 64 * 2  # bfloat16, the export dtype
    h100 = Objective("gpu", GPUS["H100"])
    assert CostMeter(h100)(names, "W4", quantized, None) == stored / 3350e9


def test_kernels_are_timed_once_per_shape_and_format(monkeypatch):
    import llmc.tune.sensitivity as sensitivity

    calls = []
    monkeypatch.setattr(sensitivity, "batch1_seconds", lambda weights, activations: calls.append(len(weights)) or 1e-5)
    meter = CostMeter(Objective("this-machine"))
    unit = quantized_unit([torch.randn(64, 64)], W4, torch.bfloat16)
    for _ in range(3):
        assert meter(["o_proj"], "W4", unit, None) == 1e-5
    meter(["o_proj"], "keep", [torch.randn(64, 64)], None)
    assert calls == [1, 1]


def test_real_kernel_timing_is_positive():
    from llmc.tune.hardware import batch1_seconds

    assert 0 < batch1_seconds(quantized_unit([torch.randn(128, 128)], W4, torch.bfloat16), None) < 0.1


def test_vllm_gpu_kernels_by_architecture():
    assert gpu_refusal("W4A16", GPUS["A100"]) is None
    assert "needs hopper or newer, A100 is ampere" in gpu_refusal("W4AFP8", GPUS["A100"])
    assert gpu_refusal("W4AFP8", GPUS["H100"]) is None
    assert "blackwell" in gpu_refusal("NVFP4", GPUS["H200"]) and gpu_refusal("NVFP4", GPUS["B200"]) is None
    assert "4- and 8-bit integer weights only" in gpu_refusal("W3A16", GPUS["B200"])
