"""The frozen pre-trained ViT (PTM): building it, loading weights, fingerprinting it, and the
explicit-attention forward that exposes each block's attention probabilities A^l.

timm's fused attention hides A^l, so ``block_with_attention`` recomputes the block from the
block's own modules (q/k/v, norms, layer scale, projection) and returns A^l next to its output;
a test holds it to timm's own block output within 1e-5. The last block is only ever needed for
the class token, so ``class_token_attention`` computes just that row of A^L.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import DrlError, PTMError, UsageError, shown
from ..seeding import seeded

# The only keyword arguments that reach ``timm.create_model``: the ViT's shape, as ``init --ptm-arg``
# records it (``synthetic.TINY_PTM_KWARGS``). Anything else (``checkpoint_path``, ``pretrained_cfg``,
# ``cache_dir``, ...) would make timm read files or change where weights come from. Each entry is
# (type, lowest, highest); the bounds keep a crafted file from building a model of absurd size.
PTM_KWARGS: dict[str, tuple[type, float, float]] = {
    "img_size": (int, 8, 4096),
    "patch_size": (int, 1, 256),
    "embed_dim": (int, 8, 8192),
    "depth": (int, 2, 128),
    "num_heads": (int, 1, 128),
    "mlp_ratio": (float, 0.25, 16.0),
    "reg_tokens": (int, 0, 64),
    "init_values": (float, 0.0, 10.0),
    "qkv_bias": (bool, 0, 1),
    "qk_norm": (bool, 0, 1),
    "no_embed_class": (bool, 0, 1),
    "pre_norm": (bool, 0, 1),
}


@dataclass(frozen=True)
class PTMSource:
    """Where weights come from: a local file, timm's hub download, or a seeded random init.
    (An ``hf-hub:`` PTM is a local file here: ``hub.py`` finds it in the Hugging Face cache.)"""

    weights_path: Path | None = None
    random_init: bool = False
    seed: int = 0


VIT_MODULES = ("timm.models.vision_transformer", "timm.models.deit")  # where timm defines its plain ViTs


def create_ptm(
    name: str,
    *,
    source: PTMSource,
    kwargs: dict[str, Any] | None = None,
    unsupported: type[DrlError] | None = None,
) -> nn.Module:
    """Build a frozen timm ViT (no classifier head) with weights from ``source``. A timm model
    that is not a plain ViT, or of a shape too big to build, is refused before it is built: with
    ``unsupported`` (IntegrityError for a name and shape a run or export file gives), else with
    PTMError (a name the user gave) or UsageError (a shape the user gave)."""
    import timm
    from timm.models import model_entrypoint

    kwargs = check_ptm_kwargs(kwargs, origin="--ptm-arg (ptm_kwargs)")
    if not timm.is_model(name):
        raise PTMError(f"unknown PTM {name!r}; pass a timm ViT name such as deit_tiny_patch16_224, or hf-hub:timm/REPO")
    if model_entrypoint(name.split(".")[0]).__module__ not in VIT_MODULES:
        raise (unsupported or PTMError)(f"{name} is not a timm ViT with a class token; use a vit_* or deit_* model")
    if kwargs:
        _check_size(name, kwargs, error=unsupported or UsageError)
    model = _build(name, source, kwargs)
    check_supported(model, name, error=unsupported or PTMError)
    if source.weights_path is not None:
        load_weights(model, source.weights_path)
    model.eval()
    model.requires_grad_(False)
    return model


def _build(name: str, source: PTMSource, kwargs: dict[str, Any]) -> nn.Module:
    """timm's model: pretrained from the hub (timm's download) when no file and no random init is asked."""
    import timm

    from_hub = source.weights_path is None and not source.random_init
    try:
        if from_hub:
            _require_hub(name)
            return timm.create_model(name, pretrained=True, num_classes=0, **kwargs)
        with seeded(source.seed):  # CPU init: no CUDA context, no GPU generator touched
            return timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
    except PTMError:
        raise
    except Exception as exc:  # timm/hub raise many kinds; all mean the same to the user
        if from_hub:
            why = f"cannot get pretrained weights for {name} ({exc.__class__.__name__}); offline? {fetch_hint(name)}"
            raise PTMError(why) from exc
        raise PTMError(f"cannot build PTM {name} with {kwargs}: {exc}") from exc


MAX_PTM_PARAMS = 3_000_000_000  # 12 GB in fp32: above ViT-G/14 (1.8 B), far below what the shape bounds allow
MAX_PTM_TOKENS = 4_096  # tokens per image: a 64 x 64 patch grid (attention costs their square)


def _check_size(name: str, kwargs: dict[str, Any], *, error: type[DrlError]) -> None:
    """Shape arguments each in range can still multiply into a model no machine holds (a run
    file's embed_dim 8192, depth 128, mlp_ratio 16: 309 B parameters): count the parameters and
    tokens of the model they make, built on the meta device (no memory), before building it."""
    import timm

    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
    except Exception as exc:  # timm raises many kinds for shapes that do not fit together
        raise PTMError(f"cannot build PTM {name} with {kwargs}: {exc}") from exc
    params = sum(p.numel() for p in model.parameters())
    tokens = getattr(getattr(model, "patch_embed", None), "num_patches", 0) or 0
    if params > MAX_PTM_PARAMS or tokens > MAX_PTM_TOKENS:
        raise error(
            f"PTM {name} with {kwargs} would have {params / 1e9:.1f} B parameters and {tokens} patch tokens "
            f"per image; drl builds at most {MAX_PTM_PARAMS / 1e9:.0f} B and {MAX_PTM_TOKENS}: pick a smaller shape"
        )


def check_ptm_kwargs(kwargs: Any, *, origin: str, error: type[DrlError] = UsageError) -> dict[str, Any]:
    """``kwargs`` if every key is in ``PTM_KWARGS`` with a value of its type and range; else ``error``
    (UsageError from the CLI/API, IntegrityError from a run or export file) naming ``origin``."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise error(f"PTM keyword arguments from {origin} must be a mapping, got {type(kwargs).__name__}")
    allowed = ", ".join(PTM_KWARGS)
    for key, value in kwargs.items():
        if key not in PTM_KWARGS:
            raise error(
                f"PTM keyword argument {shown(key)} from {origin} is not allowed (drl passes only {allowed}); remove it"
            )
        kind, low, high = PTM_KWARGS[key]
        if not _is_kind(value, kind) or not low <= value <= high:
            want = {bool: "true or false", int: "an int", float: "a number"}[kind]
            want += "" if kind is bool else f" in [{low:g}, {high:g}]"
            raise error(f"PTM keyword argument {key}={shown(value)} from {origin} must be {want}")
    return dict(kwargs)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))  # 10**400: no float


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set: the hub library uses its local cache only."""
    import os

    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def hub_host() -> str:
    import os

    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached (the error's class name), in seconds; None when it can."""
    import socket

    try:
        socket.create_connection((hub_host().split(":")[0], 443), timeout=timeout).close()
    except OSError as exc:
        return exc.__class__.__name__
    return None


def _require_hub(name: str) -> None:
    """Fail in seconds, not after a minute of hub retries, when the hub cannot be reached."""
    if hub_offline():
        return  # the hub library fails fast itself (or uses its local cache)
    problem = hub_unreachable()
    if problem is not None:
        raise PTMError(f"cannot reach {hub_host()} to download {name} weights ({problem}); {fetch_hint(name)}")


def fetch_hint(name: str) -> str:
    """How to get ``name``'s weights onto a machine without the hub: its timm repo, fetched into the
    Hugging Face cache elsewhere and copied over, or a local file."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    repo = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
    if not repo:
        return "pass --ptm-weights FILE (a local .safetensors)"
    return (
        f"fetch it where the hub is reachable with `hf download {repo} config.json model.safetensors`, copy "
        f"the Hugging Face cache (HF_HUB_CACHE) here, and pass --ptm hf-hub:{repo}; or pass --ptm-weights FILE "
        "(a local .safetensors)"
    )


def check_supported(model: nn.Module, name: str, *, error: type[DrlError] = PTMError) -> None:
    from timm.models.vision_transformer import Attention, Block, VisionTransformer

    if not isinstance(model, VisionTransformer) or getattr(model, "cls_token", None) is None:
        raise error(f"{name} is not a timm ViT with a class token; use a vit_* or deit_* model")
    for block in model.blocks:
        if type(block) is not Block or type(block.attn) is not Attention:
            raise error(f"{name} uses {type(block).__name__} blocks; only standard ViT blocks work")
        if getattr(block.attn, "gate", None) is not None:
            raise error(f"{name} has gated attention, which the IPA network does not support")
    if len(model.blocks) < 2:
        raise error(f"{name} has {len(model.blocks)} block(s); the IPA network needs at least 2")


def read_weights_file(path: Path) -> dict[str, Tensor]:
    path = Path(path)
    if not path.exists():
        raise PTMError(f"weights file {path} not found; pass an existing --ptm-weights FILE")
    if not path.is_file():  # a folder, FIFO or device: never opened (a FIFO would block)
        raise PTMError(f"weights file {path} is not a regular file; pass a .safetensors file as --ptm-weights")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only, no code
    except Exception as exc:
        raise PTMError(f"cannot read weights file {path}: {exc}; pass a valid .safetensors") from exc
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    return state


def load_weights(model: nn.Module, path: Path) -> None:
    state = {k: v for k, v in read_weights_file(path).items() if not k.startswith("head.")}
    load_state(model, state, origin=str(path))


def load_state(model: nn.Module, state: dict[str, Tensor], *, origin: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise PTMError(
            f"weights {origin} do not fit this PTM (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); pass the weights of the model named by --ptm"
        )
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise PTMError(
                f"weights {origin}: {key} has shape {tuple(value.shape)}, the PTM expects "
                f"{tuple(expected[key].shape)}; pass the weights of the model named by --ptm"
            )
    model.load_state_dict(state, strict=True)


def fingerprint(model: nn.Module) -> str:
    """sha256 over a module's tensors (names, dtypes, shapes, bytes): independent of file format."""
    return tensors_sha256(model.state_dict())


def tensors_sha256(tensors: dict[str, Tensor]) -> str:
    """sha256 over named tensors (names, dtypes, shapes, bytes), in name order."""
    digest = hashlib.sha256()
    for key, value in sorted(tensors.items()):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def data_config(model: nn.Module) -> dict[str, Any]:
    """The PTM's resolved preprocessing (input size, interpolation, mean/std, crop), JSON-safe."""
    from timm.data import resolve_data_config

    cfg = resolve_data_config({}, model=model)
    # the pretrained config names the checkpoint's size; the built model may have another
    cfg["input_size"] = (cfg["input_size"][0], *model.patch_embed.img_size)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


def width(model: nn.Module) -> int:
    return int(model.embed_dim)


# ---------------------------------------------------------------- explicit-attention forward


def embed_tokens(model: nn.Module, images: Tensor) -> Tensor:
    """Patch embedding + class token + position embedding: f^0, shared by every stream. (B, N, d)"""
    x = model.patch_embed(images)
    x = model._pos_embed(x)
    x = model.patch_drop(x)
    return model.norm_pre(x)


def _heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, N, d) -> (B, H, N, d/H)"""
    b, n, d = x.shape
    return x.view(b, n, num_heads, d // num_heads).transpose(1, 2)


def block_with_attention(block: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """One frozen ViT block; returns its output (B, N, d) and attention probabilities (B, H, N, N)."""
    attn = block.attn
    h = block.norm1(x)
    q, k, v = attn.qkv(h).chunk(3, dim=-1)
    q, k, v = (_heads(t, attn.num_heads) for t in (q, k, v))
    q, k = attn.q_norm(q), attn.k_norm(k)
    probs = torch.softmax((q * attn.scale) @ k.transpose(-2, -1), dim=-1)  # (B, H, N, N)
    out = (probs @ v).transpose(1, 2).flatten(2)  # (B, N, d)
    x = x + block.ls1(attn.proj(attn.norm(out)))
    x = x + block.ls2(block.mlp(block.norm2(x)))
    return x, probs


def class_token_attention(block: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The class-token row of a block's attention (B, H, N) and the values it mixes (B, H, N, d/H)."""
    attn = block.attn
    d = x.shape[-1]
    h = block.norm1(x)
    weight, bias = attn.qkv.weight, attn.qkv.bias
    q = F.linear(h[:, :1], weight[:d], None if bias is None else bias[:d])  # (B, 1, d)
    kv = F.linear(h, weight[d:], None if bias is None else bias[d:])  # (B, N, 2d)
    k, v = kv.chunk(2, dim=-1)
    q, k, v = (_heads(t, attn.num_heads) for t in (q, k, v))
    q, k = attn.q_norm(q), attn.k_norm(k)
    probs = torch.softmax((q * attn.scale) @ k.transpose(-2, -1), dim=-1).squeeze(2)  # (B, H, N)
    return probs, v


def ptm_layout(model: nn.Module, x: Tensor, grid: int) -> Tensor:
    """The image's layout in the PTM: the last block for every token (input ``x``, the block before's
    output), the final norm, and the patch tokens averaged over a ``grid`` x ``grid`` partition of
    the image, (B, grid², d), cells in row-major order. A cell's mean says what is where, which the
    class token alone does not (Caltech-101's Faces and Faces_easy: the same faces, two framings)."""
    y = model.blocks[-1](x)  # timm's own block (fused attention): no (B, H, N, N) probabilities kept
    return layout_cells(model, model.norm(y), grid)


def layout_cells(model: nn.Module, tokens: Tensor, grid: int) -> Tensor:
    """The patch tokens of a final-normed output ``tokens`` (B, N, d) averaged over a ``grid`` x
    ``grid`` partition of the image, (B, grid², d), cells in row-major order."""
    patches = tokens[:, model.num_prefix_tokens :]  # (B, P, d)
    b, p, d = patches.shape
    side = math.isqrt(p)
    if side * side != p or side < grid:
        raise ValueError(f"the PTM's {p} patch tokens are not a square grid of at least {grid} x {grid}")
    cells = F.adaptive_avg_pool2d(patches.transpose(1, 2).reshape(b, d, side, side), grid)  # (B, d, g, g)
    return cells.flatten(2).transpose(1, 2)


def ptm_probe(model: nn.Module, x: Tensor) -> Tensor:
    """The class token of a block's output ``x`` (B, N, d) through the PTM's final norm, (B, d): what
    an earlier block knows of the image, in f_0's normalisation (the open-set score reads it)."""
    return model.fc_norm(model.norm(x[:, 0]))


def ptm_class_feature(model: nn.Module, x: Tensor, cls_probs: Tensor, values: Tensor) -> Tensor:
    """Last PTM block for the class token only, then the final norm: f_0. (B, d)"""
    block = model.blocks[-1]
    mixed = (cls_probs.unsqueeze(2) @ values).squeeze(2).flatten(1)  # (B, d)
    y = x[:, 0] + block.ls1(block.attn.proj(block.attn.norm(mixed)))
    y = y + block.ls2(block.mlp(block.norm2(y)))
    return model.fc_norm(model.norm(y))
