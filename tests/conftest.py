import json
import os
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker takes its share of the cores, and so do the processes it starts (torch's and
    vLLM's OpenMP threads): two workers of two threads each on two cores spin in each other's barriers (the `not slow`
    set took 2.5x as long)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // workers)
    first = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) * share % len(cores)
    mine = cores[first : first + share]
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
    torch.set_num_threads(len(mine))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("four-layers"), num_layers=4)


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    sentences = CORPUS.split(". ")
    with open(path, "w") as file:
        for index in range(60):
            text = ". ".join(sentences[index % 4 : index % 4 + 3])
            file.write(json.dumps({"text": text, "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


@pytest.fixture(scope="session")
def eval_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "eval.txt"
    path.write_text(CORPUS[::-1] + CORPUS)
    return path


@pytest.fixture(scope="session")
def distilled(tmp_path_factory, tiny_llama, calib_file):
    from llmc.draft.data import self_distill

    return self_distill(tiny_llama, calib_file, 6, 24, tmp_path_factory.mktemp("distill-parts"))


@pytest.fixture(scope="session")
def trained(tmp_path_factory, distilled) -> tuple[Path, list[list[int]]]:
    """Medusa heads trained on the tiny model's own answers, and the prompts (as token ids) they were trained on."""
    from llmc.draft.build import train_medusa
    from llmc.draft.config import DraftConfig

    folder = tmp_path_factory.mktemp("draft")
    train_medusa(distilled, DraftConfig(num_heads=3, steps=150, batch_size=64, lr=1e-2), folder)
    return folder, [ids[:start] for ids, start in zip(distilled.token_ids, distilled.answer_starts)]



@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 2`, as .ci/run runs the suite): each test module runs whole on one worker, so that its
    module fixtures are built once, and the vLLM modules (tests/integration/test_vllm_*.py) share one worker, first:
    they build one venv, vLLM binds its thread to a core, and together they take longest."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "vllm" if Path(module).name.startswith("test_vllm_") else module

        def _assign_work_unit(self, node) -> None:
            if "vllm" in self.workqueue:
                self.workqueue.move_to_end("vllm", last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)
