"""`llmc quantize RECIPE --nproc N`: the same command in N processes under torchrun (torch.distributed.run), which
sets each one's RANK, WORLD_SIZE and LOCAL_RANK; the pipeline joins them into one process group. What would
make the ranks fail for certain is refused here first, in one line."""
import os
import subprocess
import sys

import torch

from llmc.core.errors import LlmcError
from llmc.pipeline.recipe import Recipe


def check_ranks(recipe: Recipe, nproc: int) -> None:
    if "WORLD_SIZE" in os.environ:
        raise LlmcError("--nproc under torchrun: torchrun already started the ranks; drop --nproc")
    if recipe.calibration is None or not recipe.needs_calibration:
        raise LlmcError("--nproc splits the calibration samples, and no stage of this recipe uses any: drop --nproc")
    if recipe.calibration.num_samples < nproc:
        raise LlmcError(f"--nproc {nproc} shares calibration.num_samples {recipe.calibration.num_samples} "
                        "among the ranks: give each rank one sample at least")
    if recipe.device.startswith("cuda:"):
        raise LlmcError(f"device: {recipe.device} names one GPU; with --nproc use device: cuda (rank r computes on cuda:r)")
    if recipe.device != "cpu" and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise LlmcError(f"--nproc {nproc} ranks, one per GPU, but {torch.cuda.device_count()} GPU(s) are visible")


def launch_ranks(recipe: Recipe, nproc: int, arguments: list[str]) -> None:
    """Runs `llmc quantize ARGUMENTS` in nproc processes and waits for them; rank 0 writes the artifact."""
    check_ranks(recipe, nproc)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "llmc", "quantize", *arguments]
    environment = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))}
    code = subprocess.run(command, env=environment).returncode
    if code != 0:
        raise LlmcError(f"{nproc} ranks under torchrun: one failed (exit code {code}); its error is above")
