"""Random paged batches for `tqgen verify` and the tests.

`paged_batch` lays out ragged sequences over a shuffled set of cache blocks
(so block ids are not in order and pages are not contiguous), fills the keys
and values, and returns everything a store/decode/dequantize call needs.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import Config


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
