"""PTMs from the Hugging Face Hub, named as timm names them: ``hf-hub:timm/<repo>[@revision]``.

timm builds such a model itself (``timm.create_model("hf-hub:...", pretrained=True)``): it fetches
the repo's ``config.json``, builds its ``architecture`` with the config's ``model_args`` and
``pretrained_cfg``, and loads the weights, from a pickle (``pytorch_model.bin``) when the repo has
no safetensors. drl takes the same steps under its own rules:

- both files come through the local Hugging Face cache (``huggingface_hub.hf_hub_download``), from
  one snapshot; the hub is asked only when it can be reached and HF_HUB_OFFLINE is not set, and a
  file in neither place is a PTMError naming the ``hf download`` command that fetches it;
- ``config.json`` is data: strict JSON (at most 1 MiB), its architecture a timm model name, its
  ``model_args`` held to ``backbone.PTM_KWARGS``, and of its ``pretrained_cfg`` only the
  preprocessing (``DATA_KEYS``) is read, checked as a run's (``config.check_data_config``);
- the weights come only from ``model.safetensors``.

The run records the timm architecture and keyword arguments as ``ptm.name``/``ptm.kwargs`` (so
exports and every later load need no hub), and under ``ptm.hub`` the repo, the snapshot's commit
and the weights file's sha256; a later load takes the weights of that commit from the cache.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .. import jsonio, storage
from ..errors import PTMError, UsageError
from . import backbone
from .backbone import PTMSource
from .record import HUB_COMMIT, HUB_REPO, check_data_config

PREFIX = "hf-hub:"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# What drl reads of a config's pretrained_cfg: the preprocessing; input_size is the built model's
DATA_KEYS = ("interpolation", "mean", "std", "crop_pct", "crop_mode")


def is_hub_name(name: str) -> bool:
    return name.startswith(PREFIX)


@dataclass(frozen=True)
class HubPTM:
    """An ``hf-hub:`` PTM, built: what ``init`` records in run.yaml's ``ptm`` section."""

    model: nn.Module  # frozen, its weights loaded from the snapshot's model.safetensors
    name: str  # the timm architecture of config.json
    kwargs: dict[str, Any]  # config.json's model_args, then --ptm-arg's
    data_config: dict[str, Any]
    record: dict[str, str]  # ptm.hub: repo, revision (the snapshot's commit), weights_sha256


def load_hub_ptm(name: str, *, kwargs: dict[str, Any] | None = None) -> HubPTM:
    """Build ``hf-hub:ORG/NAME[@REVISION]`` from the Hugging Face cache (``kwargs``, checked by the
    caller, override config.json's ``model_args``)."""
    repo, revision = parse_hub_name(name)
    why_local = _why_local()
    config_path = _fetch(repo, CONFIG_FILE, revision=revision, name=name, why_local=why_local)
    commit = _snapshot_commit(config_path, name)
    weights_path = _fetch(repo, WEIGHTS_FILE, revision=commit, name=name, why_local=why_local)  # the same snapshot
    architecture, model_args, preprocessing = read_config(config_path)
    merged = {**model_args, **(kwargs or {})}
    model = backbone.create_ptm(architecture, source=PTMSource(weights_path=weights_path), kwargs=merged)
    data_config = {**backbone.data_config(model), **preprocessing}
    try:
        check_data_config(data_config)
    except UsageError as exc:
        raise PTMError(f"{config_path}: its pretrained_cfg gives an unusable preprocessing ({exc})") from None
    record = {"repo": repo, "revision": commit, "weights_sha256": file_sha256(weights_path)}
    return HubPTM(model, architecture, merged, data_config, record)


def cached_weights(record: dict[str, str]) -> Path:
    """The weights of a run's ``ptm.hub`` (already checked: ``config.check_hub_record``), from its commit."""
    repo, commit = record["repo"], record["revision"]
    return _fetch(repo, WEIGHTS_FILE, revision=commit, name=f"{PREFIX}{repo}@{commit}", why_local=_why_local())


def parse_hub_name(name: str) -> tuple[str, str | None]:
    """``hf-hub:ORG/NAME[@REVISION]`` -> (ORG/NAME, REVISION or None), as timm splits it."""
    repo, _, revision = name[len(PREFIX) :].partition("@")
    if not HUB_REPO.fullmatch(repo) or ".." in repo or "--" in repo:
        raise PTMError(
            f"{name!r} does not name a Hugging Face repo; write hf-hub:ORG/NAME, e.g. hf-hub:timm/{_EXAMPLE}"
        )
    if revision and (len(revision) > 255 or not all(c.isalnum() or c in "._-/" for c in revision)):
        raise PTMError(f"{name!r} has an invalid revision {revision!r}; give a branch, tag or commit after @")
    return repo, revision or None


_EXAMPLE = "vit_base_patch16_224.augreg2_in21k_ft_in1k"


def download_command(repo: str, revision: str | None) -> str:
    """The command that puts a repo's files where ``load_hub_ptm`` looks for them."""
    return f"hf download {repo} {CONFIG_FILE} {WEIGHTS_FILE}" + (f" --revision {revision}" if revision else "")


def cache_dir() -> Path:
    """The Hugging Face cache, found as huggingface_hub finds it (HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub), but at each call: the library
    reads the environment once, when it is imported."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expanduser(os.path.expandvars(path)))


def _why_local() -> str | None:
    """Why only the cache can be read (HF_HUB_OFFLINE, or no route to the hub), or None."""
    if backbone.hub_offline():
        return "is switched off (HF_HUB_OFFLINE)"
    problem = backbone.hub_unreachable()
    return f"cannot be reached ({problem})" if problem else None


def _fetch(repo: str, filename: str, *, revision: str | None, name: str, why_local: str | None) -> Path:
    """A file of the repo from the cache; from the hub (into the cache) only when ``why_local`` is None."""
    from huggingface_hub import hf_hub_download

    cache = cache_dir()
    command = download_command(repo, revision)
    try:
        path = hf_hub_download(
            repo, filename, revision=revision, cache_dir=cache, local_files_only=why_local is not None
        )
    except Exception as exc:  # the hub library raises many kinds; each means the file is not to be had
        if why_local is not None:
            raise PTMError(
                f"{name} is not in the Hugging Face cache {cache} (no {filename}) and the hub {why_local}; "
                f"fetch it where there is network with `{command}` (same HF_HUB_CACHE/HF_HOME), then run this again"
            ) from None
        first_line = (str(exc).splitlines() or [""])[0]
        raise PTMError(
            f"{name}: cannot download {filename} ({exc.__class__.__name__}: {first_line}); "
            f"check the repo name, or fetch it with `{command}`"
        ) from exc
    return Path(path)


def _snapshot_commit(path: Path, name: str) -> str:
    """The commit of the cache snapshot a file was taken from (.../snapshots/<commit>/<file>)."""
    commit = path.parent.name
    if path.parent.parent.name != "snapshots" or not HUB_COMMIT.fullmatch(commit):
        raise PTMError(f"{name}: {path} is not in a Hugging Face cache snapshot; fetch the repo with the hf command")
    return commit


def read_config(path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """config.json's (architecture, model_args, preprocessing), each checked; PTMError naming the file."""
    cfg = _read_json(path)
    architecture = cfg.get("architecture")
    if not isinstance(architecture, str) or not _is_timm_model(architecture):
        raise PTMError(f"{path} names no timm model (architecture {architecture!r}); it is not a timm repo drl can use")
    model_args = cfg.get("model_args") or {}
    model_args = backbone.check_ptm_kwargs(model_args, origin=f"{path} (model_args)", error=PTMError)
    pretrained_cfg = cfg.get("pretrained_cfg", cfg)  # timm's older single-dict layout has no pretrained_cfg
    if not isinstance(pretrained_cfg, dict):
        raise PTMError(f"{path}: pretrained_cfg is a {type(pretrained_cfg).__name__}, not a mapping")
    return architecture, model_args, {k: pretrained_cfg[k] for k in DATA_KEYS if k in pretrained_cfg}


def _read_json(path: Path) -> dict[str, Any]:
    """config.json, read only if it is a regular file (the cache's link followed) of at most 1 MiB."""
    try:
        data = storage.read_regular(path, limit=MAX_CONFIG_BYTES, what="hub config", follow=True)
    except ValueError as exc:
        raise PTMError(f"{exc}; it is not a timm config.json: fetch the repo again") from None
    except OSError as exc:
        raise PTMError(f"cannot read {path} ({exc.strerror}); fetch the repo again") from None
    try:
        cfg = jsonio.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise PTMError(f"{path} is not valid JSON ({str(exc).splitlines()[0]}); fetch the repo again") from None
    if not isinstance(cfg, dict):
        raise PTMError(f"{path} is not a JSON object; it is not a timm config.json")
    return cfg


def _is_timm_model(name: str) -> bool:
    import timm

    return not is_hub_name(name) and timm.is_model(name)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
