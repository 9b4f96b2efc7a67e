"""Where inductor keeps what it compiles for the runtime (C++ kernels, FX graphs): under LLMC_HOME, so a later start
reuses it."""
import os

from llmc.checkpoints.spec import llmc_home


def use_llmc_inductor_cache() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(llmc_home() / "inductor"))
