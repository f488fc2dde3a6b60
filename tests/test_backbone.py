import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from drlcli.errors import PTMError
from drlcli.ptm import backbone
from drlcli.ptm.backbone import PTMSource
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS


def test_explicit_attention_block_matches_timm(tiny_ptm, images):
    x = backbone.embed_tokens(tiny_ptm, images)
    for block in tiny_ptm.blocks:
        ours, probs = backbone.block_with_attention(block, x)
        theirs = block(x)
        assert torch.allclose(ours, theirs, atol=1e-5)
        assert probs.shape == (3, block.attn.num_heads, x.shape[1], x.shape[1])
        assert torch.allclose(probs.sum(-1), torch.ones_like(probs.sum(-1)), atol=1e-6)
        x = theirs


def test_class_token_path_matches_full_forward(tiny_ptm, images):
    x = backbone.embed_tokens(tiny_ptm, images)
    for block in tiny_ptm.blocks[:-1]:
        x = block(x)
    _, full_probs = backbone.block_with_attention(tiny_ptm.blocks[-1], x)
    cls_probs, values = backbone.class_token_attention(tiny_ptm.blocks[-1], x)
    assert torch.allclose(cls_probs, full_probs[:, :, 0], atol=1e-6)
    feature = backbone.ptm_class_feature(tiny_ptm, x, cls_probs, values)
    reference = tiny_ptm.forward_head(tiny_ptm.forward_features(images), pre_logits=True)
    assert torch.allclose(feature, reference, atol=1e-5)


def test_ptm_is_frozen_and_in_eval_mode(tiny_ptm):
    assert not tiny_ptm.training
    assert not any(p.requires_grad for p in tiny_ptm.parameters())


def test_fingerprint_tracks_weights(tiny_ptm):
    before = backbone.fingerprint(tiny_ptm)
    assert before == backbone.fingerprint(tiny_ptm)
    with torch.no_grad():
        tiny_ptm.blocks[0].attn.qkv.weight[0, 0] += 1e-3
    assert backbone.fingerprint(tiny_ptm) != before


def test_local_weights_round_trip(tmp_path, tiny_ptm):
    path = tmp_path / "w.safetensors"
    state = {k: v.contiguous() for k, v in tiny_ptm.state_dict().items()}
    state["head.weight"] = torch.zeros(5, 64)  # a classifier head is ignored
    save_file(state, str(path))
    loaded = backbone.create_ptm(TINY_PTM, source=PTMSource(weights_path=path), kwargs=TINY_PTM_KWARGS)
    assert backbone.fingerprint(loaded) == backbone.fingerprint(tiny_ptm)


def test_missing_weights_file_is_a_clear_error(tmp_path):
    with pytest.raises(PTMError, match="not found"):
        backbone.create_ptm(
            TINY_PTM, source=PTMSource(weights_path=tmp_path / "nope.safetensors"), kwargs=TINY_PTM_KWARGS
        )


def test_weights_of_another_model_are_refused(tmp_path):
    other = backbone.create_ptm(TINY_PTM, source=PTMSource(random_init=True), kwargs={**TINY_PTM_KWARGS, "depth": 3})
    path = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(path))
    with pytest.raises(PTMError, match="do not fit"):
        backbone.create_ptm(TINY_PTM, source=PTMSource(weights_path=path), kwargs=TINY_PTM_KWARGS)


def test_hub_download_offline_fails_fast_and_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(PTMError, match="--ptm-weights"):
        backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource())
    assert time.perf_counter() - start < 30


def test_unknown_and_unsupported_models_are_refused():
    with pytest.raises(PTMError, match="unknown PTM"):
        backbone.create_ptm("not_a_model", source=PTMSource(random_init=True))
    with pytest.raises(PTMError, match="class token"):
        backbone.create_ptm("resnet18", source=PTMSource(random_init=True))


def test_data_config_uses_the_built_input_size(tiny_ptm):
    cfg = backbone.data_config(tiny_ptm)
    assert cfg["input_size"] == [3, 32, 32]
    assert {"mean", "std", "interpolation", "crop_pct"} <= set(cfg)


@pytest.mark.realdata
def test_real_deit_tiny_weights_load_and_match_timm(shared_data):
    path = shared_data / "deit_tiny_patch16_224" / "deit_tiny_patch16_224.safetensors"
    model = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=Path(path)))
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    x = backbone.embed_tokens(model, images)
    ours, _ = backbone.block_with_attention(model.blocks[0], x)
    assert torch.allclose(ours, model.blocks[0](x), atol=1e-5)
    assert backbone.data_config(model)["input_size"] == [3, 224, 224]


def test_unreachable_hub_fails_fast_with_the_fix(monkeypatch):
    import socket

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1")
    monkeypatch.setattr(socket, "create_connection", _refuse)
    start = time.monotonic()
    with pytest.raises(PTMError, match=r"cannot reach 127.0.0.1.*--ptm-weights FILE"):
        backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource())
    assert time.monotonic() - start < 5


def _refuse(*args, **kwargs):
    raise ConnectionRefusedError("refused")
