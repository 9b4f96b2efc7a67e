"""The engine on artifacts whose activations and KV cache are quantized at run time, against the evaluation's
emulation in transformers; the engine's imports on a machine without the server's and the evals' packages."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, write_recipe

from llmc.evals.loading import load_model
from llmc.pipeline.quantize import run_quantize
from llmc.pipeline.recipe import load_recipe
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.layers.quantized_input_linear import QuantizedInputLinear
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [" ".join(CORPUS.split()[start : start + 6]) for start in (0, 13, 29)]
NEW_TOKENS = 24
CASES = {  # name: (stage, KV cache dtype)
    "w8a8": ("  - type: rtn\n    scheme: W8A8\n", "fp8"),
    "fp8": ("  - type: rtn\n    scheme: FP8_DYNAMIC\n", "fp8"),
    "nvfp4": ("  - type: rtn\n    scheme: NVFP4\n", "nvfp4"),
}


@pytest.fixture(scope="module", params=list(CASES))
def artifact(request, tmp_path_factory, tiny_llama, calib_file):
    stage, kv_dtype = CASES[request.param]
    folder = tmp_path_factory.mktemp(f"{request.param}-kv-{kv_dtype}")
    recipe = write_recipe(folder / "recipe.yaml", tiny_llama, folder / "artifact", stage, calib_file)
    recipe.write_text(recipe.read_text() + f"kv_cache: {{dtype: {kv_dtype}}}\n")
    return run_quantize(load_recipe(recipe))


def emulated_greedy(artifact: Path) -> list[list[int]]:
    loaded = load_model(str(artifact))
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([loaded.tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            generated = loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
            )
        outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def test_engine_quantizes_activations_and_kv_like_the_emulation(artifact):
    llm = LLM(str(artifact), EngineConfig(dtype=torch.float32, num_kv_blocks=32))
    nvfp4 = artifact.parent.name.startswith("nvfp4")  # an NVFP4 cache is kept in the compute dtype, its values rounded
    assert llm.runner.kv_cache.dtype == (torch.float32 if nvfp4 else torch.float8_e4m3fn)
    layer = llm.runner.model.layers[0]
    assert (layer.self_attn.attn.cache.nvfp4 is not None) == nvfp4
    if not nvfp4:  # NVFP4's inputs are emulated (EmulatedInputLinear) on the CPU
        assert isinstance(layer.self_attn.qkv_proj, QuantizedInputLinear) and isinstance(layer.mlp.down_proj, QuantizedInputLinear)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [output["token_ids"] for output in outputs] == emulated_greedy(artifact)


IMPORT_CHECK = """
import importlib.abc, sys
ABSENT = {"pydantic", "compressed_tensors", "fastapi", "datasets", "lm_eval", "uvicorn", "openai", "gguf", "matplotlib"}

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Absent())
import torch
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
import llmc.runtime.engine.cuda_graphs, llmc.runtime.layers.triton_attention, llmc.runtime.layers.triton_w4a16
import llmc.runtime.layers.triton_act_quant, llmc.runtime.layers.triton_elementwise
llm = LLM(sys.argv[1], EngineConfig(dtype=torch.float32, num_kv_blocks=16))
out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
assert len(out[0]["token_ids"]) == 4
print("ok", sorted(name for name in sys.modules if name.split(".")[0] in ABSENT))
"""


def test_engine_and_kernels_import_without_server_and_eval_packages(tiny_llama):
    pytest.importorskip("triton")
    env = {"PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(tiny_llama)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok []", result.stderr[-3000:]
