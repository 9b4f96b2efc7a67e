"""A C++ extension compiled with the machine's compiler on first use (torch.utils.cpp_extension.load_inline, cached in
torch's extension folder, TORCH_EXTENSIONS_DIR) and kept for the process; None where it cannot be built, so that its
caller falls back to torch ops."""
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# what the kernels are compiled with: this machine's vector units, OpenMP threads, and no contraction of a product and a
# sum into an FMA where a kernel's source does not ask for one (the kernels reproduce torch ops' bits)
COMPILER_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]

# C++ for the kernels' sources to start with: where the compiler targets AVX-512, widen16 loads 16 float32, bfloat16
# (widened by a shift) or float16 values as float32
WIDEN16 = r"""
#if defined(__AVX512F__)
#include <immintrin.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
static inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m512 widen16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif
"""


@dataclass
class CppKernel:
    name: str
    source: str
    functions: list[str] | None  # None: the source binds its own module (PYBIND11_MODULE)
    compiler_flags: list[str]
    fallback: str  # what serves instead, for the warning
    _module: object | None = field(default=None, init=False)
    _tried: bool = field(default=False, init=False)

    def get(self):
        """The compiled extension (built, or read from the cache, on the first call); None where it cannot be built."""
        if not self._tried:
            self._tried = True
            from torch.utils.cpp_extension import load_inline

            try:
                self._module = load_inline(self.name, cpp_sources=self.source, functions=self.functions,
                                           extra_cflags=self.compiler_flags, extra_ldflags=["-fopenmp"])
            except Exception as error:  # no compiler, no ninja, a toolchain error
                logger.warning("the C++ kernel %s could not be built (%s); %s", self.name, error, self.fallback)
        return self._module


def build_concurrently(kernels: list[CppKernel]) -> None:
    """Build (or read from the cache) these extensions side by side: each compiler runs in its own process, so a
    first start on several cores waits for the slowest build, not their sum."""
    with ThreadPoolExecutor(max_workers=max(1, len(kernels))) as pool:
        list(pool.map(CppKernel.get, kernels))
