import math

import torch

from drlcli.features.losses import ce_loss, cosface_loss, das_loss, kd_loss


def test_das_matches_hand_computed_example():
    logits = torch.tensor([[2.0, 0.5, -1.0]])
    target = torch.tensor([0])
    # L_pos = -log(e^2 / (e^2 + e^1)); L_neg = -log(e^1 / (e^0.5 + e^-1 + e^1))
    l_pos = -math.log(math.exp(2) / (math.exp(2) + math.exp(1)))
    l_neg = -math.log(math.exp(1) / (math.exp(0.5) + math.exp(-1) + math.exp(1)))
    expected = 3 * l_pos + 1 * l_neg
    assert abs(das_loss(logits, target).item() - expected) < 1e-6


def test_das_separate_anchors_and_weights():
    logits = torch.tensor([[0.0, 1.0], [3.0, -2.0]])
    target = torch.tensor([1, 0])
    got = das_loss(logits, target, anchor_pos=2.0, anchor_neg=0.5, lambda_pos=1.0, lambda_neg=2.0)
    sp = lambda v: math.log1p(math.exp(v))  # noqa: E731
    rows = [
        sp(2.0 - 1.0) + 2 * (math.log(math.exp(0.5) + math.exp(0.0)) - 0.5),
        sp(2.0 - 3.0) + 2 * (math.log(math.exp(0.5) + math.exp(-2.0)) - 0.5),
    ]
    assert abs(got.item() - sum(rows) / 2) < 1e-6


def test_das_trains_a_single_class_where_ce_cannot():
    logits = torch.tensor([[0.3], [0.8]], requires_grad=True)
    target = torch.tensor([0, 0])
    das = das_loss(logits, target)
    ce = ce_loss(logits, target)
    assert ce.item() == 0.0  # softmax over one class: nothing to learn
    assert das.item() > 0.0
    das.backward()
    assert (logits.grad < 0).all()  # pushes the positive logit up, towards the anchor


def test_das_negative_term_vanishes_when_negatives_far_below_anchor():
    logits = torch.tensor([[50.0, -50.0, -50.0]])
    assert das_loss(logits, torch.tensor([0])).item() < 1e-6


def test_kd_loss_is_cosine_distance():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    b = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    assert abs(kd_loss(a, b).item() - 0.5) < 1e-6  # (1 - 0 + 1 - 1) / 2


def test_cosface_takes_the_margin_off_the_target_cosine():
    """σ·(cos θ_y - m) against σ·cos θ_j: by hand; m 0 is cross-entropy; a stage of one class learns nothing."""
    scale = torch.tensor(4.0)
    cos = torch.tensor([[0.9, 0.2, -0.1], [0.1, 0.5, 0.3]])
    target = torch.tensor([0, 2])
    rows = []
    for row, y in zip(cos.tolist(), target.tolist()):
        z = [4.0 * (c - 0.35 * (j == y)) for j, c in enumerate(row)]
        rows.append(-z[y] + math.log(sum(math.exp(v) for v in z)))
    got = cosface_loss(scale * cos, target, scale=scale, margin=0.35)
    assert abs(got.item() - sum(rows) / 2) < 1e-6
    assert torch.allclose(cosface_loss(scale * cos, target, scale=scale, margin=0.0), ce_loss(scale * cos, target))
    assert got > ce_loss(scale * cos, target)  # the margin makes every target harder to meet
    assert cosface_loss(scale * cos[:, :1], torch.tensor([0, 0]), scale=scale, margin=0.35).item() == 0.0
