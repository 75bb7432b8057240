"""Hugging Face model folders and GGUF files -> our modules (weights), tokenizer and identity.

A model folder holds ``config.json``, weights as ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``), tokenizer files and optionally ``generation_config.json``.
config.json is parsed by :mod:`batchgen.model.config`. A ``.gguf`` file instead holds all of it
(:mod:`batchgen.model.gguf` maps it onto the same config and Hugging Face tensor names).
Every problem is a ``ModelError`` whose message is one line naming the problem and the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchgen.errors import ModelError
from batchgen.model.architecture import WeightPlan
from batchgen.model.attention import AttentionBackend
from batchgen.model.config import (
    ModelConfig,
    ModelInfo,
    is_gguf,
    model_info,
    model_path,
    one_line,
    read_json,
)
from batchgen.model.layers.backend import LayerBackend
from batchgen.model.layers.rotary import Rotary
from batchgen.model.registry import architecture, read_model_config

__all__ = [
    "check_model",
    "describe_gguf",
    "load_model",
    "load_tokenizer",
    "model_identity",
]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


def _weight_files(root: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"invalid safetensors index {index}: no 'weight_map'")
        files = {name: root / str(file) for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise ModelError(f"weight shard listed in {index} not found: {file}")
        return files
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"no weights (*.safetensors) found in {root}")
    files: dict[str, Path] = {}
    for shard in shards:
        if not os.access(shard, os.R_OK):
            raise ModelError(f"cannot read weight file {shard}: permission denied")
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    files[name] = shard
        except Exception as err:  # safetensors raises its own error types
            raise ModelError(
                f"corrupt or truncated safetensors file {shard}: {one_line(err)}"
            ) from None
    return files


def _weight_plan(cfg: ModelConfig, has: Callable[[str], bool]) -> WeightPlan:
    """The architecture's weight plan (:mod:`batchgen.model.registry`); ``has(name)``: whether
    the checkpoint holds that HF tensor."""
    return architecture(cfg.architecture).weights(cfg, has)


def _check_weights(root: Path, cfg: ModelConfig) -> tuple[WeightPlan, dict[str, Path]]:
    """The weight plan, and each HF tensor the model needs mapped to its file, after checking
    from the safetensors headers alone (no tensor is read) that every file is complete and
    readable, and that every needed tensor is there with the shape config.json implies. Raises
    ModelError."""
    from safetensors import safe_open

    files = _weight_files(root)
    plan = _weight_plan(cfg, files.__contains__)
    needed = plan.needed()
    for hf in needed:
        if hf not in files:
            raise ModelError(f"tensor {hf} missing from the weights in {root}")
    by_file: dict[Path, list[str]] = {}
    for hf in needed:
        by_file.setdefault(files[hf], []).append(hf)
    expected = plan.shapes
    for file, names in sorted(by_file.items()):
        if not os.access(file, os.R_OK):
            raise ModelError(f"cannot read weight file {file}: permission denied")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                shapes = {hf: tuple(f.get_slice(hf).get_shape()) for hf in names if hf in present}
        except Exception as err:  # safetensors raises its own error types
            raise ModelError(
                f"corrupt or truncated safetensors file {file}: {one_line(err)}"
            ) from None
        for hf in names:
            if hf not in shapes:
                raise ModelError(f"tensor {hf} missing from {file}")
            if shapes[hf] != expected[hf]:
                raise ModelError(
                    f"weight shape mismatch in {root}: {hf} is {shapes[hf]} in {file.name}; "
                    f"config.json implies {expected[hf]}"
                )
    return plan, files


_LINKABLE_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja")


def check_model(model_dir: str | Path) -> None:
    """Check a model folder without loading weights or the tokenizer (cheap: config.json, the
    safetensors headers and the tokenizer files): the config is supported, every weight file is
    complete, every tensor is there with the right shape, a tokenizer is there.

    Raises ModelError with one line naming the problem and the file. Run before anything is
    written, so a half-copied model folder is refused before the job touches its output folder.
    """
    root = model_path(model_dir)
    if is_gguf(root):
        _check_gguf_weights(root, *read_model_config(root))
        return
    try:
        broken = sorted(
            p for p in root.iterdir() if p.suffix in _LINKABLE_SUFFIXES and not p.exists()
        )
    except OSError as err:
        raise ModelError(f"cannot read model folder {root}: {err.strerror or err}") from None
    if broken:  # is_symlink and exists() False: e.g. a copied HF cache snapshot without blobs
        raise ModelError(
            f"{broken[0]} is a broken link (target {os.readlink(broken[0])} is missing); "
            "is the model folder completely copied?"
        )
    cfg, _ = read_model_config(root)
    _check_tokenizer_files(root)
    _check_weights(root, cfg)


def load_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionBackend[Any],
    native: bool = True,
    layers: LayerBackend | None = None,
) -> tuple[nn.Module, ModelInfo]:
    """Build the model on ``device`` in ``dtype`` with the checkpoint's weights (eval mode).

    ``attention`` and ``layers`` are the engine's choice (:class:`~batchgen.engine.backends.Backends`);
    without ``layers`` the fastest available here (:meth:`LayerBackend.select`: the C kernels and
    packed GEMM weights, oneDNN on CPU fp32 and bf16); ``native=False``: PyTorch ops only.
    """
    root = model_path(model_dir)
    cfg, eos = read_model_config(root)
    if is_gguf(root):
        plan, gguf = _check_gguf_weights(root, cfg, eos)
    else:
        plan, files = _check_weights(root, cfg)

    # Modules are built on the meta device (no memory, no random init); real tensors are
    # assigned below. The RoPE tables are built on the CPU explicitly and moved afterwards.
    if layers is None:  # outside the meta device: it may compile
        layers = LayerBackend.select(device, dtype, native)
    with torch.device("meta"):
        model = architecture(cfg.architecture).model(cfg, attention, layers)
    expected = {name: p.shape for name, p in model.named_parameters()}
    assert set(expected) == set(plan.sources), sorted(set(expected) ^ set(plan.sources))

    needed = plan.needed()
    if is_gguf(root):
        loaded = {hf: gguf.load(hf, dtype, device) for hf in needed}
    else:
        loaded = _load_safetensors(files, needed, device, dtype)

    state: dict[str, torch.Tensor] = {}
    for ours, hf_names in plan.sources.items():
        parts = [loaded.pop(hf) for hf in hf_names]
        if ours in plan.transforms:
            tensor = plan.transforms[ours](parts)
        else:
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tensor.shape != expected[ours] and tensor.numel() == expected[ours].numel():
            # stacked experts: [E * rows, cols] concatenated -> [E, rows, cols]
            tensor = tensor.view(expected[ours])
        if tensor.shape != expected[ours]:
            shapes = ", ".join(
                f"{hf} {tuple(p.shape)}" for hf, p in zip(hf_names, parts, strict=True)
            )
            raise ModelError(
                f"weight shape mismatch in {root}: {shapes}; config.json implies {tuple(expected[ours])}"
            )
        state[ours] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()  # the model holds the weights now: packing can free each one it replaces
    for module in model.modules():  # the RoPE tables (built on the CPU)
        if isinstance(module, Rotary):
            module.to(device)
    model.eval().requires_grad_(False)
    model.pack_weights()
    return model, model_info(cfg, eos)


def _load_safetensors(
    files: dict[str, Path], needed: list[str], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The HF tensors ``needed`` from the safetensors files that hold them (``files``, checked
    by :func:`_check_weights`), cast to ``dtype``."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for hf in needed:
        by_file.setdefault(files[hf], []).append(hf)
    loaded: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for hf in sorted(names):
                    loaded[hf] = f.get_tensor(hf).to(device=device, dtype=dtype)
        except Exception as err:
            raise ModelError(
                f"corrupt or truncated safetensors file {file}: {one_line(err)}"
            ) from None
    return loaded


def _check_gguf_weights(
    root: Path, cfg: ModelConfig, eos: tuple[int, ...]
) -> tuple[WeightPlan, Any]:
    """The weight plan and the opened GGUF file, after checking that every tensor the model
    needs is there with the shape its metadata implies (from the tensor index alone) and that it
    names an EOS token."""
    from batchgen.model.gguf import GgufModel, gguf_name

    gguf = GgufModel.open(root)

    def has(hf: str) -> bool:
        try:
            return gguf.shape(hf) is not None
        except KeyError:  # a name llama.cpp's format has no mapping for
            return False

    plan = _weight_plan(cfg, has)
    expected = plan.shapes
    for hf in plan.needed():
        shape = gguf.shape(hf)
        if shape is None:
            raise ModelError(f"tensor {gguf_name(hf)} missing from GGUF file {root}")
        if shape != expected[hf]:
            raise ModelError(
                f"weight shape mismatch in {root}: {gguf_name(hf)} is {shape}; its metadata "
                f"implies {expected[hf]}"
            )
    if not eos:
        raise ModelError(f"GGUF file {root} names no EOS token (tokenizer.ggml.eos_token_id)")
    return plan, gguf


def describe_gguf(path: str | Path, dtype: torch.dtype | None) -> str:
    """A GGUF file's tensor types and its size after dequantizing to ``dtype`` (float32 when
    not yet decided), for validate."""
    from batchgen.model.gguf import GgufModel

    return GgufModel.open(model_path(path)).describe(dtype or torch.float32)


# --------------------------------------------------------------------------------------------
# tokenizer and identity
# --------------------------------------------------------------------------------------------


def _check_tokenizer_files(root: Path) -> None:
    """A tokenizer file is there, and ``tokenizer.json``, if any, is complete JSON."""
    if not any(
        (root / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise ModelError(
            f"no tokenizer found in {root} (tokenizer.json, tokenizer.model or vocab.json)"
        )
    path = root / "tokenizer.json"
    if path.is_file():
        try:
            json.loads(path.read_bytes())
        except (OSError, ValueError) as err:
            raise ModelError(f"invalid tokenizer file {path}: {one_line(err)}") from None


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer via ``AutoTokenizer`` (local files only, never the network)."""
    root = model_path(model_dir)
    if is_gguf(root):
        from batchgen.model.gguf import GgufModel

        return GgufModel.open(root).tokenizer()
    _check_tokenizer_files(root)
    try:
        if _generic_tokenizer_class(root):
            # the class AutoTokenizer would pick, without the model-config imports it makes to
            # choose (about 0.8 s of a run's start-up)
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as err:
        raise ModelError(f"cannot load the tokenizer in {root}: {one_line(err)}") from None


# tokenizer_config.json's tokenizer_class values that name transformers' generic fast tokenizer
# (one tokenizer.json run by the tokenizers library), not a model-specific class
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_tokenizer_class(root: Path) -> bool:
    """Whether ``root``'s tokenizer is transformers' generic fast tokenizer with its
    tokenizer.json."""
    config = root / "tokenizer_config.json"
    if not (config.is_file() and (root / "tokenizer.json").is_file()):
        return False
    try:
        cls = json.loads(config.read_bytes()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return cls in _GENERIC_TOKENIZER_CLASSES


def _safetensors_header(path: Path) -> bytes:
    """The 8-byte length plus the JSON header of a safetensors file (names, dtypes, shapes, offsets)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(
                f"corrupt or truncated safetensors file {path}: shorter than its header"
            )
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 1024 * 1024:
            raise ModelError(f"corrupt safetensors file {path}: implausible header size {size}")
        return head + f.read(size)


def model_identity(model_dir: str | Path) -> str:
    """A cheap stable hash of what decides the model's outputs (hex sha256).

    Covers config.json, generation_config.json, the tokenizer files' contents, and each weight
    file's name, size, safetensors header and a sample of its bytes (``_WEIGHT_SAMPLES`` evenly
    spaced chunks): weights fine-tuned to new values of the same shapes change the identity,
    while hashing stays fast for checkpoints of many GB.

    Checks the folder first (:func:`check_model`): a job fingerprints its model before it opens
    its output folder, so a broken model never leaves a folder bound to a broken model's
    identity behind.
    """
    check_model(model_dir)
    root = model_path(model_dir)
    try:
        return _identity(root)
    except OSError as err:
        raise ModelError(
            f"cannot read model file {err.filename or root}: {err.strerror or err}"
        ) from None


def _identity(root: Path) -> str:
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(label.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)

    if is_gguf(root):
        from batchgen.model.gguf import GgufModel

        for label, data in GgufModel.open(root).identity_parts():
            add(label, data)
        add("gguf:sample", _sample_bytes(root))
        return digest.hexdigest()
    for name in ("config.json", "generation_config.json", *_TOKENIZER_FILES):
        path = root / name
        if path.is_file():
            add(name, path.read_bytes())
    index = root / "model.safetensors.index.json"
    if index.is_file():
        add(index.name, index.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        add(f"{path.name}:{path.stat().st_size}", _safetensors_header(path))
        add(f"{path.name}:sample", _sample_bytes(path))
    return digest.hexdigest()


_WEIGHT_SAMPLES = 64  # chunks read from each weight file for its identity
_WEIGHT_SAMPLE_BYTES = 16 * 1024


def _sample_bytes(path: Path) -> bytes:
    """Evenly spaced chunks of a file (the whole file when it is small)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= _WEIGHT_SAMPLES * _WEIGHT_SAMPLE_BYTES:
            return f.read()
        step = (size - _WEIGHT_SAMPLE_BYTES) // (_WEIGHT_SAMPLES - 1)
        chunks = []
        for i in range(_WEIGHT_SAMPLES):
            f.seek(i * step)
            chunks.append(f.read(_WEIGHT_SAMPLE_BYTES))
        return b"".join(chunks)
