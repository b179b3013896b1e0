"""The TurboQuant codebook and rotations.

Centroids: the Lloyd-Max quantizer of a Gaussian N(0, 1/D), i.e. the
standard-normal Lloyd-Max levels divided by sqrt(D), solved here in double
precision and baked into emitted modules as literals.

Rotations: `hadamard_matrix` (normalized Sylvester Hadamard, power-of-two D
only; symmetric and its own inverse) and `random_orthogonal_matrix` (QR of a
seeded Gaussian, any D). The functions listed in `EMBEDDED`
depend on math and torch alone because `render` copies their source verbatim
into every emitted module: tqgen and the modules it emits build the very same
matrices and quantize from the very same inputs.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def lloyd_max_levels(bits: int) -> tuple[float, ...]:
    """The 2**bits Lloyd-Max reconstruction levels of N(0, 1), ascending."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    n = 2**bits

    def pdf(x: float) -> float:
        return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)

    def cdf(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    # Start from equiprobable cells' midpoints; iterate centroid <-> midpoint.
    levels = [math.sqrt(2.0) * _erfinv(2.0 * (i + 0.5) / n - 1.0) for i in range(n)]
    for _ in range(100_000):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        new = []
        for lo, hi in zip(edges, edges[1:]):
            mass = cdf(hi) - cdf(lo)
            new.append((pdf(lo) - pdf(hi)) / mass)
        delta = max(abs(a - b) for a, b in zip(new, levels))
        levels = new
        if delta < 1e-15:
            break
    # Enforce exact symmetry (the solver is symmetric up to rounding).
    half = [0.5 * (levels[n - 1 - i] - levels[i]) for i in range(n // 2)]
    return tuple([-h for h in half] + list(reversed(half)))


def _erfinv(y: float) -> float:
    """Inverse error function by Newton's method (only seeds the solver)."""
    x = 0.0
    for _ in range(100):
        err = math.erf(x) - y
        x -= err / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
        x = max(min(x, 6.0), -6.0)
    return x


# Copied into every emitted module by render.py (one source of truth).
EMBEDDED = ("hadamard_matrix", "random_orthogonal_matrix", "rotate_keys", "decision_boundaries")


def centroids(bits: int, head_dim: int) -> list[float]:
    """Lloyd-Max centroids for N(0, 1/head_dim): what MSE keys are coded with."""
    scale = 1.0 / math.sqrt(head_dim)
    return [level * scale for level in lloyd_max_levels(bits)]


# The store's table search (Plan.store_cell_search): |y| * 2**shift + SEARCH_ROUNDING, in fp32, holds the product
# rounded to an integer in its low mantissa bits (exactly: the product is exact, the sum rounds once, fused or not),
# and its low 7 bits are y's cell, one of SEARCH_CELLS (a NaN's canonical bits, 0x7fffffff, give the last).
SEARCH_ROUNDING = 1.5 * 2.0**23
SEARCH_CELLS = 128


def search_cell(magnitude: torch.Tensor, shift: int) -> torch.Tensor:
    """The cell of each fp32 |y| as tq_store_gluon computes it (a NaN's taken as the GPU's canonical NaN)."""
    bits = (magnitude.to(torch.float32) * 2.0**shift + SEARCH_ROUNDING).view(torch.int32) & (SEARCH_CELLS - 1)
    return torch.where(torch.isnan(magnitude), SEARCH_CELLS - 1, bits.to(torch.int64))


def search_cells(bits: int, head_dim: int) -> int:
    """The shift of the store's table search of the default codebook: the cells (search_cell) narrower than the
    closest two of the upper half's decision boundaries, so at most one lies in a cell, checked on the fp32
    boundaries a module computes (default_centroids' fp32 levels, decision_boundaries' fp32 midpoints); every
    |y| <= 1 (a coordinate of a unit vector) falls below the last cell, kept for NaN."""
    centroid_values = torch.tensor(centroids(bits, head_dim), dtype=torch.float32)
    upper = decision_boundaries(centroid_values)[2 ** (bits - 1):]  # above the middle one (0)
    gap = (upper[1:] - upper[:-1]).min().item() if upper.numel() > 1 else upper[0].item()
    shift = math.floor(-math.log2(gap)) + 1
    cells = search_cell(upper, shift)
    if not bool((cells[1:] > cells[:-1]).all()) or 2**shift >= SEARCH_CELLS - 1:
        raise ValueError(f"search_cells: the {bits}-bit codebook at head_dim {head_dim} needs cells of 2**-{shift}, "
                         f"which the table of {SEARCH_CELLS} cannot hold one boundary a cell for")
    return shift


def hadamard_matrix(dim, device=None):
    """Normalized Sylvester Hadamard matrix H/sqrt(dim), float32 [dim, dim]."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(dim)).to(device=device, dtype=torch.float32)


def random_orthogonal_matrix(dim, seed, device=None):
    """Seeded random orthogonal matrix, float32 [dim, dim].

    QR of a Gaussian drawn from a CPU generator, in float64, with the signs of
    R's diagonal folded into Q so the result is unique for a given seed.
    """
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs[None, :]).to(device=device, dtype=torch.float32)


def rotation_matrix(kind: str, dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """The rotation a config names ('hadamard' or 'random')."""
    if kind == "hadamard":
        return hadamard_matrix(dim, device)
    if kind == "random":
        return random_orthogonal_matrix(dim, seed, device)
    raise ValueError(f"unknown rotation {kind!r}; expected 'hadamard' or 'random'")


def rotate_keys(key, rotation):
    """The MSE key transform before coding: (norm, rotated unit vector), float32.

    `n = ||k||`, `y = (k / (n + 1e-8)) @ rotation`: the reference's definition, and
    what the store launcher runs for a rotation other than the config's Hadamard
    matrix. For that matrix the store kernel computes the same by a Walsh-Hadamard
    transform, in its own order of fp32 operations: its codes can then differ where
    y lies within rounding of a decision boundary (`tqgen.testing.store_differences`).
    """
    key = key.to(torch.float32)
    norm = torch.linalg.vector_norm(key, dim=-1)
    unit = key / (norm + 1e-8).unsqueeze(-1)
    return norm, unit @ rotation.to(device=key.device, dtype=torch.float32)


def decision_boundaries(centroid_values):
    """Midpoints between sorted centroids, float32; a code is the count of boundaries <= y.

    Comparing `y >= boundary` sends ties to the upper bucket (docs/format.md). The
    store launcher and the reference both call this, so they compare against
    bit-identical boundaries.
    """
    c = centroid_values.to(torch.float32)
    return (c[1:] + c[:-1]) * 0.5
