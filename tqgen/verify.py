"""`tqgen verify`: the generated kernels against the reference on random data.

Each check runs the emitted module and `tqgen.reference` on the same inputs:
store must match byte for byte (except MSE key codes of coordinates on a
decision boundary, see `store_differences`), dequantize and decode within the
tolerance of their arithmetic (fp16 tensor-core operands in decode).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch

from . import reference
from .config import Config
from .layout import Layout
from .testing import codebook_kwargs, paged_batch, relative_error

# Relative L2 error bounds. Decode multiplies fp16 operands (query, centroids or
# fp8 keys, probabilities) on the tensor cores with fp32 accumulation; the
# output dtype's rounding comes on top (bf16: about 2**-9).
DECODE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1.5e-3, torch.bfloat16: 6e-3}
DEQUANT_TOLERANCE = 1e-6  # fp32 output: only summation order differs
# The store kernel rotates MSE keys in its own order of fp32 operations (a Walsh-Hadamard
# transform), the reference by torch's matmul: the rotated unit key y (|y| <= 1) differs
# by about 1e-7. A key code may differ where the exact y lies this close to a boundary.
BOUNDARY_TIE = 1e-5


def store_differences(config: Config, cache: torch.Tensor, expected: torch.Tensor, key: torch.Tensor,
                      slot_mapping: torch.Tensor, rotation: torch.Tensor | None = None,
                      centroids: torch.Tensor | None = None) -> int:
    """How many bytes of a stored cache differ from the reference's, not counting ties.

    Every byte must match exactly, except for MSE keys: each code must be that of the
    float64 rotated key, or where that lies within BOUNDARY_TIE of a decision boundary,
    the code of either side (both are then the nearest centroid to rounding); the fp16
    norm may differ by one unit in the last place (fp32 sums in another order). A
    norm-corrected norm ("planes") of a token whose codes took the other side of a tie is
    compared with the exact quotient for the codes it stored. Each code or norm outside
    these limits counts as one differing byte.
    """
    layout = Layout.from_config(config)
    if layout.key_fp8:
        return int((cache != expected).sum())
    got, want = reference.as_slots(config, cache).clone(), reference.as_slots(config, expected).clone()
    written = slot_mapping >= 0
    slots = slot_mapping[written].to(torch.int64)
    where = (slots // layout.page_size, slots % layout.page_size)
    got_rows, want_rows = got[where], want[where]  # [tokens, heads, slot_bytes]: copies
    codes = reference.unpack_codes(got_rows[..., : layout.key_code_bytes], layout.key_bits, config.head_dim)
    norm = slice(layout.key_norm_offset, layout.key_norm_offset + 2)
    norm_bits = [rows[..., norm].contiguous().view(torch.int16).squeeze(-1).to(torch.int32)
                 for rows in (got_rows, want_rows)]
    for view, rows in ((got, got_rows), (want, want_rows)):  # key fields: compared below
        rows[..., : layout.key_code_bytes] = 0
        rows[..., norm] = 0
        view[where] = rows
    differing = int((got != want).sum())  # every other byte must be equal

    exact = key[written].double()
    exact_norm = exact.norm(dim=-1)
    unit = exact / (exact_norm[..., None] + 1e-8)
    rotated = (unit @ rotation.double().to(unit.device)).unsqueeze(-1).to(codes.device)
    boundaries = reference.decision_boundaries(centroids).double().to(codes.device)
    lowest = (rotated - BOUNDARY_TIE >= boundaries).sum(-1)  # the code of each side of a tie
    highest = (rotated + BOUNDARY_TIE >= boundaries).sum(-1)
    differing += int(((codes < lowest) | (codes > highest)).sum())
    if layout.key_norm_corrected:
        # The norm is divided by the norm of the stored codes' centroids: where a tie took the other
        # code, compare with the exact quotient for the codes stored instead of the reference's bytes.
        corrected = reference.corrected_norm(exact_norm.to(codes.device), centroids.to(codes.device)[codes],
                                             dtype=torch.float64)
        want_codes = reference.unpack_codes(want_rows[..., : layout.key_code_bytes], layout.key_bits, config.head_dim)
        tied = (codes != want_codes).any(-1)
        exact_bits = corrected.to(torch.float16).view(torch.int16).to(torch.int32)
        norm_bits[1] = torch.where(tied, exact_bits, norm_bits[1])
    differing += int(((norm_bits[0] - norm_bits[1]).abs() > 1).sum())
    return differing


@dataclasses.dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str


def run_checks(module: ModuleType, config: Config, *, device: str = "cuda", seed: int = 0,
               seq_lens: tuple[int, ...] | None = None, num_kv_heads: int = 2, group_size: int = 4,
               progress: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Store, dequantize and decode checks on one random ragged batch."""
    page = config.block_size
    if seq_lens is None:
        seq_lens = (1, page - 1, page + 1, 3 * page + 5, 0)
    generator = torch.Generator().manual_seed(seed)
    batch = paged_batch(config, list(seq_lens), num_kv_heads, device=device, generator=generator)
    codebook = codebook_kwargs(module, device)
    rotation, centroids = codebook.get("rotation"), codebook.get("centroids")
    results: list[CheckResult] = []

    def record(name: str, passed: bool, detail: str) -> None:
        results.append(CheckResult(name, passed, detail))
        if progress:
            progress(results[-1])

    cache = module.make_cache(batch.num_blocks, num_kv_heads, device)
    expected_cache = cache.clone()
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **codebook)
    reference.store(config, batch.key, batch.value, expected_cache, batch.slot_mapping, rotation, centroids)
    differing = store_differences(config, cache, expected_cache, batch.key, batch.slot_mapping, rotation, centroids)
    record("store", differing == 0, f"{differing} of {cache.numel()} bytes differ from the reference")

    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32, **codebook)
    ref_keys, ref_values = reference.dequantize(config, cache, batch.block_table, batch.seq_lens, rotation, centroids)
    for name, got, want in (("dequantize keys", keys, ref_keys), ("dequantize values", values, ref_values)):
        err = relative_error(got, want)
        record(name, err <= DEQUANT_TOLERANCE, f"relative error {err:.2e} (limit {DEQUANT_TOLERANCE:.2g})")

    query = torch.randn(len(seq_lens), num_kv_heads * group_size, config.head_dim, generator=generator)
    for dtype in (torch.float16, torch.bfloat16):
        q = query.to(device=device, dtype=dtype)
        want = reference.decode(config, q, cache, batch.block_table, batch.seq_lens, rotation, centroids)
        for num_splits in (1, 3):
            got = module.decode(q, cache, batch.block_table, batch.seq_lens, num_splits=num_splits, **codebook)
            err = relative_error(got, want)
            limit = DECODE_TOLERANCE[dtype]
            finite = bool(torch.isfinite(got).all())
            record(f"decode {str(dtype).replace('torch.', '')} splits={num_splits}", finite and err <= limit,
                   f"relative error {err:.2e} (limit {limit:.2g}){'' if finite else ', non-finite output'}")
    return results
