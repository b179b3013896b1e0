"""Checking kernels against the reference: random data, tolerances, comparisons, and the
checks of `tqgen verify`. The tests, the tuner's correctness check and `tqgen verify` all
use these, so they agree on what "matches the reference" means.

- `paged_batch`: ragged sequences over a shuffled set of cache blocks (block ids out of
  order, pages not contiguous), with keys, values and everything store/decode/dequantize take.
- `random_cache`, `random_problem`: full-length decode batches over a random cache, for the
  tuner and the benchmark.
- `DECODE_TOLERANCE`, `DEQUANT_TOLERANCE`, `relative_error`, `store_differences`: what counts
  as a match.
- `run_checks`: store, dequantize and decode against the reference on one random batch.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch

from . import reference
from .config import Config
from .layout import Layout

# Relative L2 error bounds. Decode multiplies fp16 operands (query, centroids or
# fp8 keys, probabilities) on the tensor cores with fp32 accumulation; the
# output dtype's rounding comes on top (bf16: about 2**-9).
DECODE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1.5e-3, torch.bfloat16: 6e-3}
DEQUANT_TOLERANCE = 1e-6  # fp32 output: only summation order differs
# The store kernel rotates MSE keys in its own order of fp32 operations (a Walsh-Hadamard
# transform), the reference by torch's matmul: the rotated unit key y (|y| <= 1) differs
# by about 1e-7. A key code may differ where the exact y lies this close to a boundary.
BOUNDARY_TIE = 1e-5


@dataclasses.dataclass
class PagedBatch:
    key: torch.Tensor  # [num_tokens, num_kv_heads, D]
    value: torch.Tensor  # [num_tokens, num_kv_heads, D]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_table: torch.Tensor  # int32 [batch, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [batch]
    num_blocks: int


def codebook_kwargs(module, device) -> dict:
    """The rotation/centroids a module's launchers take: its defaults (MSE keys), none for fp8 keys."""
    if module.KEY_FORMAT == "fp8":
        return {}
    return {"rotation": module.default_rotation(device), "centroids": module.default_centroids(device)}


def fp8_representable(x: torch.Tensor) -> torch.Tensor:
    """Round to values float8 e4m3fn holds exactly (what CPU tests feed fp8 paths)."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def paged_batch(config: Config, seq_lens: list[int], num_kv_heads: int, *, device="cpu",
                dtype=torch.float16, spare_blocks: int = 3, extra_table_columns: int = 1,
                generator: torch.Generator | None = None) -> PagedBatch:
    """A ragged batch whose tokens live in shuffled cache blocks.

    `spare_blocks` unused blocks make the cache larger than the batch needs, and
    `extra_table_columns` unused block-table columns (filled with -1) check
    that kernels stop at seq_len.
    """
    # Keys and values first: they depend on the token count only, so two page
    # sizes with one seed hold the same data.
    shape = (sum(seq_lens), num_kv_heads, config.head_dim)
    key = torch.randn(shape, generator=generator) * 2.0
    value = torch.randn(shape, generator=generator) + 0.25 * torch.randn(shape[:-1], generator=generator)[..., None]
    if config.key_format == "fp8":
        key = fp8_representable(key)
    page = config.block_size
    pages = [(n + page - 1) // page for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    width = max(pages, default=0) + extra_table_columns
    block_table = torch.full((len(seq_lens), max(width, 1)), -1, dtype=torch.int32)
    slots, used = [], 0
    for b, (n, p) in enumerate(zip(seq_lens, pages)):
        block_table[b, :p] = order[used: used + p].to(torch.int32)
        used += p
        t = torch.arange(n)
        slots.append(block_table[b, t // page].to(torch.int64) * page + t % page)
    slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    return PagedBatch(
        key=key.to(device=device, dtype=dtype),
        value=value.to(device=device, dtype=dtype),
        slot_mapping=slot_mapping.to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_blocks=num_blocks,
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 when both are zero)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


def as_head_major(cache: torch.Tensor) -> torch.Tensor:
    """A slots cache's bytes laid out as vLLM allocates them (and make_cache does), [num_blocks, num_kv_heads, page,
    slot] underneath (each KV head's page contiguous), viewed in the slots layout's dim order [num_blocks, page,
    num_kv_heads, slot]. A cache already laid out so is returned as is."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def as_position_major(cache: torch.Tensor) -> torch.Tensor:
    """A slots cache's bytes in the other dim order the kernels take: contiguous [num_blocks, page, num_kv_heads,
    slot], the KV heads' slots of a position side by side."""
    return cache.contiguous()


def random_cache(module: ModuleType, config: Config, num_blocks: int, num_kv_heads: int, device,
                 generator: torch.Generator | None = None, position_major: bool = False) -> torch.Tensor:
    """A random cache in the config's layout, with plausible fields: fp16 norm/scale/zero in range, fp8 keys of N(0, 1) keys.
    A slots cache is laid out as make_cache lays it out (as_head_major); `position_major` as_position_major.

    Random fp8 bytes would give keys up to 240 and softmax weights so peaked that
    fp16 rounding of the query alone exceeds the tuner's tolerance. `generator`
    (on `device`) makes the cache reproducible; None draws from torch's global one.
    """
    cache = torch.randint(0, 256, (num_blocks, config.block_size, num_kv_heads, module.SLOT_BYTES),
                          dtype=torch.uint8, device=device, generator=generator)

    def put_fp16(offset: int, low: float, high: float) -> None:
        values = torch.empty(cache.shape[:3], device=device).uniform_(low, high, generator=generator).half()
        bits = values.view(torch.int16).to(torch.int32) & 0xFFFF
        cache[..., offset] = (bits & 0xFF).to(torch.uint8)
        cache[..., offset + 1] = (bits >> 8).to(torch.uint8)

    put_fp16(module.VALUE_SCALE_OFFSET, 0.01, 0.2)
    put_fp16(module.VALUE_ZERO_OFFSET, -1.0, 0.0)
    if config.key_format == "mse":
        put_fp16(module.KEY_NORM_OFFSET, 5.0, 20.0)
    else:
        keys = torch.randn(*cache.shape[:3], config.head_dim, device=device, generator=generator)
        cache[..., : config.head_dim] = keys.to(torch.float8_e4m3fn).view(torch.uint8)
    layout = Layout.from_config(config)
    if not layout.planes:
        return cache if position_major else as_head_major(cache)
    # The reference conversion unpacks codes to int64 bits: a block at a time keeps a large cache in memory.
    return torch.cat([reference.slots_to_pages(layout, blocks) for blocks in cache.split(1024)])


def random_problem(module: ModuleType, config: Config, batch: int, context: int, num_q_heads: int,
                   num_kv_heads: int, device, generator: torch.Generator | None = None,
                   position_major: bool = False) -> dict:
    """A full-length decode batch over a random cache in shuffled blocks: cache, block_table, seq_lens, query.

    `generator` (on `device`) makes the problem reproducible; None draws from torch's global one; `position_major`
    as random_cache's.
    """
    blocks_per_seq = -(-context // config.block_size)
    return {
        "cache": random_cache(module, config, batch * blocks_per_seq, num_kv_heads, device, generator,
                              position_major),
        "block_table": torch.randperm(batch * blocks_per_seq, device=device, generator=generator).to(torch.int32)
                            .view(batch, blocks_per_seq),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "query": torch.randn(batch, num_q_heads, config.head_dim, dtype=torch.float16, device=device,
                             generator=generator),
    }


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
    got, want = reference.as_slots(layout, cache).clone(), reference.as_slots(layout, expected).clone()
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
    layout = Layout.from_config(config)
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
    reference.store(layout, batch.key, batch.value, expected_cache, batch.slot_mapping, rotation, centroids)
    differing = store_differences(config, cache, expected_cache, batch.key, batch.slot_mapping, rotation, centroids)
    record("store", differing == 0, f"{differing} of {cache.numel()} bytes differ from the reference")

    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32, **codebook)
    ref_keys, ref_values = reference.dequantize(layout, cache, batch.block_table, batch.seq_lens, rotation, centroids)
    for name, got, want in (("dequantize keys", keys, ref_keys), ("dequantize values", values, ref_values)):
        err = relative_error(got, want)
        record(name, err <= DEQUANT_TOLERANCE, f"relative error {err:.2e} (limit {DEQUANT_TOLERANCE:.2g})")

    query = torch.randn(len(seq_lens), num_kv_heads * group_size, config.head_dim, generator=generator)
    for dtype in (torch.float16, torch.bfloat16):
        q = query.to(device=device, dtype=dtype)
        want = reference.decode(layout, q, cache, batch.block_table, batch.seq_lens, rotation, centroids)
        for num_splits in (1, 3):
            got = module.decode(q, cache, batch.block_table, batch.seq_lens, num_splits=num_splits, **codebook)
            err = relative_error(got, want)
            limit = DECODE_TOLERANCE[dtype]
            finite = bool(torch.isfinite(got).all())
            record(f"decode {str(dtype).replace('torch.', '')} splits={num_splits}", finite and err <= limit,
                   f"relative error {err:.2e} (limit {limit:.2g}){'' if finite else ', non-finite output'}")
    return results
