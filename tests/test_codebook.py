"""Centroids and rotations, in tqgen and as emitted modules rebuild them."""

import math

import pytest
import torch

from conftest import make_config
from tqgen import codebook

# docs/format.md's standard-normal Lloyd-Max levels (positive half, 4 decimals).
FORMAT_MD_LEVELS = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3439, 2.1519],
    4: [0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
}


@pytest.mark.parametrize("bits", sorted(FORMAT_MD_LEVELS))
def test_lloyd_max_levels_match_format_md(bits):
    levels = codebook.lloyd_max_levels(bits)
    assert len(levels) == 2**bits and list(levels) == sorted(levels)
    positive = levels[2 ** (bits - 1):]
    assert [round(x, 4) for x in positive] == FORMAT_MD_LEVELS[bits]
    assert all(a == -b for a, b in zip(levels, reversed(levels)))


def test_centroids_are_levels_over_sqrt_d():
    assert codebook.centroids(3, 128) == [x / math.sqrt(128) for x in codebook.lloyd_max_levels(3)]


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_hadamard_is_symmetric_orthonormal(dim):
    h = codebook.hadamard_matrix(dim).double()
    assert torch.allclose(h, h.T)
    assert torch.allclose(h @ h, torch.eye(dim, dtype=torch.float64), atol=1e-6)
    assert torch.all(h.abs() == h.abs()[0, 0])


def test_hadamard_refuses_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        codebook.hadamard_matrix(96)


@pytest.mark.parametrize("dim", [64, 96, 200])
def test_random_rotation_is_orthonormal_and_seeded(dim):
    a = codebook.random_orthogonal_matrix(dim, seed=7).double()
    assert torch.allclose(a @ a.T, torch.eye(dim, dtype=torch.float64), atol=1e-5)
    assert torch.equal(codebook.random_orthogonal_matrix(dim, seed=7), codebook.random_orthogonal_matrix(dim, seed=7))
    assert not torch.equal(codebook.random_orthogonal_matrix(dim, seed=7), codebook.random_orthogonal_matrix(dim, seed=8))


def test_decision_boundaries_send_ties_up():
    c = torch.tensor([-1.0, 0.0, 2.0])
    boundaries = codebook.decision_boundaries(c)
    assert boundaries.tolist() == [-0.5, 1.0]
    y = torch.tensor([-0.5, -0.51, 1.0, 0.99])
    assert (y[:, None] >= boundaries).sum(-1).tolist() == [1, 0, 2, 1]


@pytest.mark.parametrize("head_dim,rotation", [(128, "hadamard"), (96, "random")])
def test_emitted_module_rebuilds_the_same_codebook(build_module, head_dim, rotation):
    config = make_config("k3v4", head_dim=head_dim, rotation=rotation)
    module = build_module(config)
    assert torch.equal(module.default_rotation("cpu"), codebook.rotation_matrix(rotation, head_dim, 0))
    assert module.default_centroids("cpu").tolist() == torch.tensor(codebook.centroids(3, head_dim)).tolist()
