import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from drlcli.features.ipa import IPAConfig
from drlcli.features.ipa.network import IPANetwork
from drlcli.ptm import backbone


def _network(ptm, stages=0, randomize=False, **cfg):
    """An IPA network with ``stages`` stages: at their initialisation, or with every parameter
    perturbed (``randomize``) so that no zero-initialised term hides a mistake."""
    net = IPANetwork(ptm, IPAConfig(**cfg))
    for s in range(stages):
        net.new_stage(seed=s)
        if randomize:
            _randomize(net.stages[-1], s)
    return net


def _randomize(stage, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


@torch.no_grad()
def test_new_stage_starts_as_the_representation_it_inherits(tiny_ptm, images):
    """Interpretation I-3: f_s^l = sigmoid(gate bias)·g at every block; transfer block = PTM attention."""
    net = _network(tiny_ptm, stages=1)
    feats = net(images)
    m = torch.sigmoid(torch.tensor(net.cfg.gate_bias_init))
    x = backbone.embed_tokens(tiny_ptm, images)
    for block in tiny_ptm.blocks[:-1]:
        x = block(x)
    last = tiny_ptm.blocks[-1]
    stream = m * x  # what the stage stream holds entering the transfer block
    expected = tiny_ptm.norm(stream[:, 0] + last.attn(last.norm1(stream))[:, 0])
    assert torch.allclose(feats[:, 1], expected, atol=1e-5)
    assert torch.nn.functional.cosine_similarity(feats[:, 1], feats[:, 0]).min() > 0.5


@torch.no_grad()
def test_transfer_block_shortcut_equals_the_plain_computation(tiny_ptm, images):
    net = _network(tiny_ptm, stages=1)
    _randomize(net.stages[0], 0)
    st = net.stages[0]
    # plain reference: stream through blocks 1..L-1 is checked elsewhere; here start from any stream
    stream = torch.randn(1, 3, 17, 64)
    x = backbone.embed_tokens(tiny_ptm, images)
    for block in tiny_ptm.blocks[:-1]:
        x = block(x)
    cls_probs, _ = backbone.class_token_attention(tiny_ptm.blocks[-1], x)
    params = {k: v.unsqueeze(0) for k, v in st.state_dict().items()}
    ours = net._transfer(params, stream, cls_probs)[0]
    last = tiny_ptm.blocks[-1]
    h = last.norm1(stream[0])
    d, heads = 64, last.attn.num_heads
    v = torch.nn.functional.linear(h, last.attn.qkv.weight[2 * d :], last.attn.qkv.bias[2 * d :])
    v = v.view(3, 17, heads, d // heads).transpose(1, 2)  # (B, H, N, dh)
    mixed = (cls_probs.unsqueeze(2) @ v).squeeze(2).flatten(1)
    y = stream[0][:, 0] + last.attn.proj(mixed)
    hidden = torch.nn.functional.gelu(last.norm2(y) @ st.ffn_in + st.ffn_in_bias)
    y = y + hidden @ st.ffn_out + st.ffn_out_bias
    assert torch.allclose(ours, tiny_ptm.norm(y), atol=1e-5)


def _attention_probs(block, x):
    """(B, H, N, N) softmax(q k^T / sqrt(dh)) of a timm block, computed from scratch."""
    attn = block.attn
    b, n, d = x.shape
    q, k, _ = attn.qkv(block.norm1(x)).view(b, n, 3, attn.num_heads, d // attn.num_heads).permute(2, 0, 3, 1, 4)
    return torch.softmax(q @ k.transpose(-2, -1) / (d // attn.num_heads) ** 0.5, dim=-1)


def _reference_forward(net, images):
    """The equations of ipa.py written plainly: one stage after another, one block after another,
    full-token transfer block, timm's own forward for f_0. The fast path must equal this."""
    ptm, cfg, heads = net.ptm, net.cfg, net.num_heads
    act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu}[cfg.activation]
    x = backbone.embed_tokens(ptm, images)
    ptm_tokens, probs = [], []  # PTM output and attention of blocks 1..L
    for block in ptm.blocks:
        probs.append(_attention_probs(block, x))
        x = block(x)
        ptm_tokens.append(x)
    feats = [ptm.forward_features(images)[:, 0]]
    previous = ptm_tokens[:-1]  # the stage before the first one is the PTM
    for st in net.stages:
        x = backbone.embed_tokens(ptm, images)
        outputs = []
        for l in range(len(ptm.blocks) - 1):
            v = act(x @ st.down[l] + st.down_bias[l]) @ st.up[l] + st.up_bias[l]
            b, n, d = v.shape
            if cfg.attention == "reuse":
                v = (probs[l] @ v.view(b, n, heads, d // heads).transpose(1, 2)).transpose(1, 2).reshape(b, n, d)
            elif cfg.attention == "learned":  # the stage's own q/k over the block's norm1 of its input
                u = ptm.blocks[l].norm1(x)
                q = (u @ st.attn_q[l] + st.attn_q_bias[l]).view(b, n, heads, -1).transpose(1, 2)
                k = (u @ st.attn_k[l] + st.attn_k_bias[l]).view(b, n, heads, -1).transpose(1, 2)
                own = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
                v = (own @ v.view(b, n, heads, d // heads).transpose(1, 2)).transpose(1, 2).reshape(b, n, d)
            g = (1 - cfg.gamma) * previous[l] + cfg.gamma * ptm_tokens[l]
            m = torch.sigmoid(act(g @ st.gate_down[l] + st.gate_down_bias[l]) @ st.gate_up[l] + st.gate_up_bias[l])
            x = {"adapt": (1 - m) * v + m * g, "sum": v + g, "part": v + m * g}[cfg.gate]
            outputs.append(x)
        last = ptm.blocks[-1]
        w_v, b_v = last.attn.qkv.weight[2 * d :], last.attn.qkv.bias[2 * d :]
        values = (last.norm1(x) @ w_v.T + b_v).view(b, n, heads, d // heads).transpose(1, 2)
        y = x + last.attn.proj((probs[-1] @ values).transpose(1, 2).reshape(b, n, d))
        y = y[:, 0]
        y = y + torch.nn.functional.gelu(last.norm2(y) @ st.ffn_in + st.ffn_in_bias) @ st.ffn_out + st.ffn_out_bias
        feats.append(ptm.norm(y))
        previous = outputs
    return torch.stack(feats, dim=1)


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"gate": "sum"},
        {"gate": "part"},
        {"attention": "none"},
        {"attention": "learned"},
        {"activation": "gelu", "gamma": 0.3},
    ],
)
def test_fast_path_equals_the_plain_reference(tiny_ptm, images, cfg):
    """Batched stages, r-wide attention mixing, fused gate, class-token transfer block: same numbers."""
    net = _network(tiny_ptm, stages=3, randomize=True, **cfg)
    with torch.no_grad():
        reference = _reference_forward(net, images)
        fast = net(images)
    assert torch.allclose(fast, reference, atol=1e-5), (fast - reference).abs().max()
    for st in net.stages[:-1]:
        st.requires_grad_(False)
    f0, fs = net.forward_train(images)
    assert torch.allclose(fs, reference[:, -1], atol=1e-5) and torch.allclose(f0, reference[:, 0], atol=1e-5)


def test_stacked_weights_are_reused_and_follow_every_parameter_change(tiny_ptm, images, monkeypatch):
    """Frozen stages are stacked once, not per forward, and a forward after any change of their
    parameters (in place, or by load_state_dict) computes with the new values."""
    from drlcli.features.ipa import network as ipa

    net = _network(tiny_ptm, stages=2)
    stacks, stack = [], ipa.stack_stages
    monkeypatch.setattr(ipa, "stack_stages", lambda *args: stacks.append(1) or stack(*args))

    def uncached():  # the same stages in a new network: nothing cached
        fresh = IPANetwork(tiny_ptm, net.cfg)
        fresh.stages.extend(net.stages)
        return fresh(images)

    with torch.no_grad():
        before = net(images)
        assert torch.equal(net(images), before) and len(stacks) == 1  # no copy per forward
        _randomize(net.stages[1], 5)  # in place
        changed = net(images)
        assert torch.allclose(changed, uncached(), atol=1e-6)
        assert not torch.allclose(changed[:, 2], before[:, 2], atol=1e-4)
        other = _network(tiny_ptm, stages=1, randomize=True).stages[0].state_dict()
        net.stages[0].load_state_dict(other)
        assert torch.allclose(net(images), uncached(), atol=1e-6)


@pytest.mark.parametrize("cfg", [{}, {"gate": "sum"}, {"gate": "part"}, {"attention": "none"}])
@torch.no_grad()
def test_functional_path_equals_the_in_place_one(tiny_ptm, images, cfg, monkeypatch):
    """The exportable (functional) body, which serving graphs record, gives the in-place body's
    numbers for several frozen stages at once; serving.exportable selects it only for its block."""
    from drlcli.serving.graph import exportable

    bodies = []
    for name in ("_attend", "_attend_in_place"):
        body = getattr(IPANetwork, name)
        monkeypatch.setattr(IPANetwork, name, lambda *a, body=body, name=name: bodies.append(name) or body(*a))
    net = _network(tiny_ptm, stages=4, randomize=True, **cfg)
    in_place = net(images)
    assert set(bodies) == {"_attend_in_place"}
    bodies.clear()
    with exportable(net):
        functional = net(images)
    assert set(bodies) == {"_attend"} and not net.exportable
    assert torch.allclose(functional, in_place, atol=1e-5), (functional - in_place).abs().max()
    assert torch.allclose(functional, _reference_forward(net, images), atol=1e-5)


@torch.no_grad()
def test_stages_batched_equals_one_stage_at_a_time(tiny_ptm, images):
    """Streams computed together give the same subspaces as growing the network stage by stage."""
    net = _network(tiny_ptm, stages=3, randomize=True)
    together = net(images)
    for t in range(1, 4):
        partial = IPANetwork(tiny_ptm, net.cfg)
        partial.stages.extend(net.stages[:t])
        assert torch.allclose(partial(images), together[:, : t + 1], atol=1e-5)


@torch.no_grad()
def test_leading_subspaces_only_equal_the_full_output(tiny_ptm, images, monkeypatch):
    """forward(images, k): f_0 and the first k stages' subspaces, as in the full output; k 0 runs
    no stage stream at all (one bare PTM pass through timm's own blocks, fused attention, what a
    head reading f_0 alone needs: equal to the full output's f_0 up to float rounding)."""
    net = _network(tiny_ptm, stages=3, randomize=True)
    full = net(images)
    for k in range(4):
        assert torch.allclose(net(images, k), full[:, : k + 1], atol=1e-5)
    calls = []
    monkeypatch.setattr(net, "_ipa_block", lambda *a, **kw: calls.append(1))
    monkeypatch.setattr(net, "_transfer", lambda *a, **kw: calls.append(1))
    assert torch.allclose(net(images, 0), full[:, :1], atol=1e-5) and not calls


@torch.no_grad()
def test_layout_rows_are_the_ptms_patch_tokens_averaged_over_a_grid(tiny_ptm, images):
    """forward(images, k, layout=g): the subspaces as without it, then g² rows, the PTM's final
    patch tokens (timm's own forward) averaged over a g x g grid of the image, row-major."""
    net = _network(tiny_ptm, stages=2, randomize=True)
    full = net(images)
    tokens = tiny_ptm.forward_features(images)[:, tiny_ptm.num_prefix_tokens :]  # (B, 16, d): 4 x 4 patches
    b, _, d = tokens.shape
    quarters = tokens.reshape(b, 2, 2, 2, 2, d).mean((2, 4)).reshape(b, 4, d)  # (row, col) halves
    got = net(images, 1, layout=2)
    assert got.shape == (b, 2 + 4, d)
    assert torch.allclose(got[:, :2], full[:, :2], atol=1e-6)
    assert torch.allclose(got[:, 2:], quarters, atol=1e-5)
    assert torch.allclose(net(images, 0, layout=1)[:, 1], tokens.mean(1), atol=1e-5)
    with pytest.raises(ValueError, match="not a square grid of at least 5 x 5"):
        net(images, 0, layout=5)


def test_probe_rows_are_the_ptms_class_token_after_those_blocks(tiny_ptm, images):
    """forward(images, k, layout, probes): the rows as without probes, then per probe block the class
    token of that block's output (timm's own blocks) through the final norm."""
    net = _network(tiny_ptm, stages=2, randomize=True)
    x = tiny_ptm.norm_pre(tiny_ptm._pos_embed(tiny_ptm.patch_embed(images)))
    after = []
    for block in tiny_ptm.blocks:
        x = block(x)
        after.append(tiny_ptm.norm(x)[:, 0])
    got = net(images, 1, layout=2, probes=(0, 2))
    assert got.shape[1] == 2 + 4 + 2
    assert torch.allclose(got[:, :6], net(images, 1, layout=2), atol=1e-6)
    assert torch.allclose(got[:, 6], after[0], atol=1e-5) and torch.allclose(got[:, 7], after[2], atol=1e-5)
    assert torch.allclose(got[:, 0], after[-1], atol=1e-5)  # f_0: the last block's
    with pytest.raises(ValueError, match="not a block before the last"):
        net(images, 0, probes=(len(tiny_ptm.blocks) - 1,))


def test_forward_train_matches_inference_and_only_the_new_stage_gets_gradients(tiny_ptm, images):
    net = _network(tiny_ptm, stages=3, randomize=True)
    for st in net.stages[:-1]:
        st.requires_grad_(False)
    with torch.no_grad():
        reference = net(images)
    f0, fs = net.forward_train(images)
    assert torch.allclose(f0, reference[:, 0], atol=1e-6)
    assert torch.allclose(fs, reference[:, -1], atol=1e-5)
    fs.sum().backward()
    assert all(p.grad is not None for p in net.stages[-1].parameters())
    assert all(p.grad is None for st in net.stages[:-1] for p in st.parameters())


@pytest.mark.parametrize("cfg", [{"gate": "sum"}, {"gate": "part"}, {"attention": "none"}, {"activation": "gelu"}])
def test_ablation_variants_run_and_differ(tiny_ptm, images, cfg):
    base = _network(tiny_ptm, stages=1)
    _randomize(base.stages[0], 0)
    variant = IPANetwork(tiny_ptm, IPAConfig(**cfg))
    variant.stages.extend(base.stages)
    with torch.no_grad():
        a, b = base(images), variant(images)
    assert b.shape == a.shape and torch.isfinite(b).all()
    assert not torch.allclose(a[:, 1], b[:, 1], atol=1e-4)


def _qkv_calls(net, images):
    calls = []
    hooks = [b.attn.qkv.register_forward_hook(lambda *_: calls.append(1)) for b in net.ptm.blocks]
    with torch.no_grad():
        net(images)
    for h in hooks:
        h.remove()
    return len(calls)


def test_one_ptm_pass_for_any_number_of_stages(tiny_ptm, images):
    """Inference cost does not multiply with stages: each PTM block's q/k/v runs once per forward,
    and each extra stage adds only a small fraction of one PTM forward's FLOPs."""
    flops = {}
    for stages in (0, 1, 5):
        net = _network(tiny_ptm, stages=stages)
        assert _qkv_calls(net, images) == len(tiny_ptm.blocks) - 1  # last block: cls path, F.linear
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            net(images)
        flops[stages] = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        tiny_ptm.forward_features(images)
    bare = counter.get_total_flops()
    per_stage = (flops[5] - flops[1]) / 4
    assert flops[0] <= bare  # the PTM path is never more than one bare forward
    assert per_stage < 0.5 * bare  # a stage costs a fraction of a forward, not one (EASE's cost)
    assert abs((flops[5] - flops[0]) - 5 * per_stage) <= 0.05 * flops[5]  # linear in stages


def test_old_subspaces_unchanged_when_a_stage_is_added(tiny_ptm, images):
    net = _network(tiny_ptm, stages=2, randomize=True)
    with torch.no_grad():
        before = net(images)
    new = net.new_stage(seed=9)
    _randomize(new, 9)
    with torch.no_grad():
        after = net(images)
    assert torch.allclose(after[:, :3], before, atol=1e-5)  # batching order may change rounding only


def test_parameter_count_per_stage(tiny_ptm):
    net = _network(tiny_ptm, stages=1)
    d, r, n = 64, 8, len(tiny_ptm.blocks) - 1  # r = max(8, 64 // 16)
    expected = n * 2 * (d * r + r + r * d + d) + (d * d + d + d * d + d)
    assert net.stages[0].num_params() == expected


def test_bf16_autocast_runs_the_fast_path_and_stays_close(tiny_ptm, images):
    """Under autocast the PTM runs in bf16 and the streams stay in fp32: same features, roughly."""
    net = _network(tiny_ptm, stages=2, randomize=True)
    with torch.inference_mode():
        exact = net(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = net(images)
    cos = torch.nn.functional.cosine_similarity(low.float(), exact, dim=-1)
    assert low.shape == exact.shape and cos.min() > 0.99


def test_under_bf16_autocast_the_in_place_streams_stay_fp32(tiny_ptm, images, monkeypatch):
    """The decision for the in-place body under autocast (issue 18): its buffers, and so the out=
    matmuls writing into them and the gate's mixing, are in the streams' dtype, fp32 (autocast does
    not apply to out= calls; the PTM's own matmuls and the adapters' hidden run in bf16). The
    functional body (training, export) lets autocast choose; both stay close to fp32."""
    from drlcli.features.ipa import network as ipa
    from drlcli.serving.graph import exportable

    net = _network(tiny_ptm, stages=2, randomize=True)
    made, real = [], ipa._buffer
    monkeypatch.setattr(
        ipa, "_buffer", lambda space, name, like, shape: made.append(like.dtype) or real(space, name, like, shape)
    )
    with torch.inference_mode():
        exact = net(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            in_place = net(images)
            assert made and set(made) == {torch.float32}
            with exportable(net):
                functional = net(images)
    for low in (in_place, functional):
        assert torch.nn.functional.cosine_similarity(low.float(), exact, dim=-1).min() > 0.99


def test_learned_attention_is_a_stage_parameter_that_trains(tiny_ptm, images):
    """``attention: learned``: every stage holds its own q/k (heads·r columns per block), absent
    otherwise; they get gradients through the stage's stream, and a second stage leaves the first's
    subspace as it was."""
    net = _network(tiny_ptm, stages=1, randomize=True, attention="learned")
    first = net.stages[0]
    assert first.attn_q.shape == (len(tiny_ptm.blocks) - 1, net.width, net.num_heads * net.adapter_dim)
    assert not hasattr(_network(tiny_ptm, stages=1).stages[0], "attn_q")
    _, fs = net.forward_train(images)
    fs.square().sum().backward()
    assert first.attn_q.grad is not None and first.attn_q.grad.abs().sum() > 0
    with torch.no_grad():
        before = net(images)
        first.requires_grad_(False)
        net.new_stage(seed=9)
        assert torch.allclose(net(images)[:, :2], before, atol=1e-5)
