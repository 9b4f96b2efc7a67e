#!/usr/bin/env bash
# llmc on one GPU with nothing from the internet: the kernel tests natively on the GPU, CUDA graphs against eager
# decode, batch-1 decode tok/s with memory-bandwidth utilisation and throughput at concurrency 64 per weight format
# (fp16, W4A16, W8A8, FP8) on random weights in Llama-3-8B's and SmolLM2-135M's shapes, the stages on CUDA against
# the CPU (tests/unit/calib/test_device.py), and GPTQ W4A16 at Llama-3-8B's layer shapes on 128 x 2048 calibration tokens
# (benchmarks/scale.py: s/layer, 32-layer time against llm-compressor's, peak device memory), and an EAGLE-3 draft's
# step costs at batch 1 in Llama-3-8B's shape combined with measured acceptances (benchmarks/speculative_gpu.py), and
# the optimisation ladder (llmc bench --ladder) on a 4-layer random checkpoint in Llama-3-8B's shapes.
# Needs torch, triton and transformers; each section runs under its own time limit and a failing one stops nothing.
# SECTIONS picks some (default all: kernels graphs decode device scale speculative ladder), e.g. SECTIONS="device scale".
#   benchmarks/gpu_check.sh [gpu_bench.py options, e.g. --formats W4A16 FP8]
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false TRITON_DEFAULT_FP_FUSION=1
PYTHON=${PYTHON:-python}
status=0
SECTIONS=${SECTIONS:-kernels graphs decode device scale speculative ladder}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PYTHON -c "import torch, triton; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability())" || status=1

if want kernels; then
    echo "== kernel tests on the GPU (tests/unit/runtime/kernel_checks.py)"
    timeout 130 $PYTHON tests/unit/runtime/kernel_checks.py | grep -v "^PASS" || status=1
fi

if $PYTHON -c "import pytest" 2>/dev/null; then
    if want graphs; then
        echo "== CUDA graphs against eager decode (tests/unit/runtime/test_cuda_graphs.py)"
        timeout 50 $PYTHON -m pytest -q -p no:cacheprovider tests/unit/runtime/test_cuda_graphs.py || status=1
    fi
    if want device; then
        echo "== every stage and the draft on CUDA against the CPU (tests/unit/calib/test_device.py)"
        timeout 120 $PYTHON -m pytest -q -p no:cacheprovider tests/unit/calib/test_device.py || status=1
    fi
fi

if want decode; then
    echo "== decode benchmark (benchmarks/gpu_bench.py)"
    timeout 270 $PYTHON benchmarks/gpu_bench.py --budget-s 250 "$@" || status=1
fi

if want scale; then
    echo "== GPTQ W4A16 at Llama-3-8B's layer shapes, 128 x 2048 tokens (benchmarks/scale.py)"
    timeout 300 $PYTHON benchmarks/scale.py --layers 3 --samples 128 --seq-len 2048 --only gptq --device cuda || status=1
fi

if want speculative; then
    echo "== EAGLE-3 at batch 1 in Llama-3-8B's shape, W4A16: step costs and the speed-up they give (benchmarks/speculative_gpu.py)"
    timeout 240 $PYTHON benchmarks/speculative_gpu.py || status=1
fi

if want ladder; then
    echo "== the optimisation ladder on a 4-layer random Llama-3-8B-shaped checkpoint, W4A16 (llmc bench --ladder)"
    LADDER=$(mktemp -d)
    timeout 120 $PYTHON benchmarks/random_checkpoint.py "$LADDER/llama-3-8b-shaped" --layers 4 &&
        timeout 300 $PYTHON -m llmc bench "$LADDER/llama-3-8b-shaped" --ladder --recipe recipes/smollm2-w4a16-rtn.yaml \
            --device cuda --vllm off --budget-s 200 --max-probes 4 --num-prompts 32 --quality-items 0 --out "$LADDER/out" || status=1
fi

exit $status
