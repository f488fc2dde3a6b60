import math

import torch
import torch.nn.functional as F

from drlcli.heads.prototypes import score, score_weights, synthesize


def test_synthesis_matches_hand_computed_example():
    # 3 classes: class 0 learned in stage 1, classes 1 and 2 in stage 2; S = 3 subspaces, d = 2
    real = torch.zeros(3, 3, 2)
    real[0, :2] = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    real[1] = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    real[2] = torch.tensor([[0.0, 1.0], [0.0, 1.0], [4.0, 0.0]])
    stage = torch.tensor([1, 2, 2])
    bank = synthesize(real, stage, tau=1.0)
    # cos in subspace 1 of class 0 with classes 1, 2: 1 and 0 -> softmax weights e/(e+1), 1/(e+1)
    w1, w2 = math.e / (math.e + 1), 1 / (math.e + 1)
    expected = w1 * torch.tensor([0.0, 2.0]) + w2 * torch.tensor([4.0, 0.0])
    assert torch.allclose(bank[0, 2], expected, atol=1e-6)
    assert torch.equal(bank[:, :2], real[:, :2])  # real entries untouched
    assert torch.equal(bank[1:], real[1:])


def test_synthesis_temperature_sharpens_weights():
    real = torch.zeros(3, 3, 2)
    real[0, :2] = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    real[1] = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    real[2] = torch.tensor([[0.0, 1.0], [0.0, 1.0], [4.0, 0.0]])
    bank = synthesize(real, torch.tensor([1, 2, 2]), tau=0.01)
    assert torch.allclose(bank[0, 2], torch.tensor([0.0, 2.0]), atol=1e-4)


def test_score_weights_follow_ease_reweighting():
    weights = score_weights(torch.tensor([1, 2, 3]), 4, rho=0.1, beta=0.5)
    assert torch.allclose(weights[0], torch.tensor([0.5, 1.0, 0.05, 0.05]))
    assert torch.allclose(weights[1], torch.tensor([0.5, 0.05, 1.0, 0.05]))
    assert torch.allclose(weights[2], torch.tensor([0.5, 0.05, 0.05, 1.0]))
    # one trained subspace: no mean term; no trained subspace (SimpleCIL): PTM cosine only
    assert torch.allclose(score_weights(torch.tensor([1]), 2, rho=0.1, beta=0.5), torch.tensor([[0.5, 1.0]]))
    assert torch.allclose(score_weights(torch.tensor([1, 2]), 1, rho=0.1, beta=0.5), torch.ones(2, 1))


def test_score_reweight_and_concat_by_hand():
    feats = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (B=1, S=2, d=2)
    bank = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])  # (C=2, S=2, d=2)
    stage = torch.tensor([1, 1])
    got = score(feats, bank, stage, rule="reweight", rho=0.1, beta=2.0)
    assert torch.allclose(got, torch.tensor([[2.0 * 1 + 0.0, 2.0 * 0 + 1.0]]))
    concat = score(feats, bank, stage, rule="concat")
    expected = F.normalize(feats.flatten(1), dim=-1) @ F.normalize(bank.flatten(1), dim=-1).T
    assert torch.allclose(concat, expected)
    assert torch.allclose(concat, torch.tensor([[0.5, 0.5]]))


def test_without_ptm_subspace_stage_k_uses_subspace_k_minus_1():
    # ease layout (offset 0): S = 3 stage subspaces, no PTM subspace, no β term
    weights = score_weights(torch.tensor([1, 2, 3]), 3, rho=0.1, beta=0.5, offset=0)
    assert torch.allclose(weights[0], torch.tensor([1.0, 0.05, 0.05]))
    assert torch.allclose(weights[2], torch.tensor([0.05, 0.05, 1.0]))
    assert torch.allclose(score_weights(torch.tensor([1, 1]), 1, rho=0.1, beta=0.5, offset=0), torch.ones(2, 1))
    # synthesis with offset 0 equals synthesis with a PTM subspace prepended (and dropped again)
    real = torch.randn(5, 3, 4)
    stage = torch.tensor([1, 1, 2, 3, 3])
    for c, k in enumerate(stage.tolist()):
        real[c, k:] = 0.0  # not seen: to be synthesised
    with_ptm = torch.cat([torch.randn(5, 1, 4), real], dim=1)
    assert torch.allclose(synthesize(real, stage, offset=0), synthesize(with_ptm, stage, offset=1)[:, 1:])
    assert torch.count_nonzero(synthesize(real, stage, offset=0)[0, 2]) > 0
