"""Plain PyTorch reference of store, dequantize and decode.

Written for clarity, not speed: per-field byte slicing driven by `Layout`,
float64 by default. Every function takes the config's `Layout` (built once by the
caller: `Layout.from_config(config)`, or `Plan.layout`). The tests compare the
generated kernels against it, and `tqgen verify` does the same on random data.

Conventions (docs/format.md):
- MSE keys: stored as codes of `y = (k / (||k|| + 1e-8)) @ rotation` plus the
  fp16 norm. Reconstruction: `k_hat = n * c_hat @ rotation.T` where `c_hat` is
  the centroid vector, divided by its own norm when norm correction is on.
  (vLLM writes the decode-side query rotation as `q @ Pi^T`, which equals
  `q @ Pi` for the symmetric Hadamard matrix; for a general orthogonal matrix
  the consistent choice is `q @ Pi`, which tqgen uses everywhere.)
- FP8 keys: e4m3fn bytes of the key clamped to +-448 (saturating).
- Values: per token and head, `scale = max((max - min) / (2^b - 1), 1e-8)`,
  codes `clamp(floor((v - min) / scale + 0.5), 0, 2^b - 1)`, fp16 scale and
  fp16 min stored; decode `v_hat = code * scale16 + zero16`.
"""

from __future__ import annotations

import torch

from .codebook import decision_boundaries, rotate_keys
from .layout import SPLIT_HIGH_ORDER, SPLIT_LOW_ORDER, Layout

FP8_MAX = 448.0


# --- bit packing -------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [..., n] into little-endian bit-stream bytes [..., ceil(n*bits/8)]."""
    n = codes.shape[-1]
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes.to(torch.int64).unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [..., n*bits]
    pad = (-stream.shape[-1]) % 8
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = 1 << torch.arange(8, device=codes.device)
    packed = (stream.unflatten(-1, (-1, 8)) * weights).sum(-1)
    assert packed.shape[-1] == (n * bits + 7) // 8
    return packed.to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_codes`: bytes [..., nbytes] -> int64 codes [..., count]."""
    bit_index = torch.arange(8, device=packed.device)
    stream = ((packed.to(torch.int64).unsqueeze(-1) >> bit_index) & 1).flatten(-2)
    stream = stream[..., : count * bits].unflatten(-1, (count, bits))
    return (stream << torch.arange(bits, device=packed.device)).sum(-1)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 values [...] -> little-endian bytes [..., 2]."""
    as_int = x.to(torch.float16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([as_int & 0xFF, as_int >> 8], dim=-1).to(torch.uint8)


def _fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """little-endian bytes [..., 2] -> fp16 values [...]."""
    as_int = b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)
    as_int = torch.where(as_int >= 0x8000, as_int - 0x10000, as_int)
    return as_int.to(torch.int16).view(torch.float16)


def fp8_e4m3fn_bytes(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to float8 e4m3fn, returned as raw bytes."""
    clamped = x.to(torch.float32).clamp(-FP8_MAX, FP8_MAX)
    return clamped.to(torch.float8_e4m3fn).view(torch.uint8)


# --- the two cache layouts -----------------------------------------------------
def _code_bits(layout: Layout, start: int) -> int | None:
    """Bits per code of the record starting at slot byte `start`; None for norms, scales and padding."""
    return {layout.key_code_offset: layout.key_bits, layout.value_code_offset: layout.value_bits}.get(start)


def _record_to_planes(record: torch.Tensor, layout: Layout, bits: int | None) -> torch.Tensor:
    """A record's slot bytes -> its "planes" bytes (3-bit codes: low-bit stream, then high bits,
    each group of 8 codes in the orders SPLIT_LOW_ORDER and SPLIT_HIGH_ORDER)."""
    if bits is None or not layout.split_high_bits(bits):
        return record
    groups = unpack_codes(record, 3, layout.head_dim).unflatten(-1, (-1, 8))
    low = (groups[..., list(SPLIT_LOW_ORDER)] & 3).flatten(-2)
    high = (groups[..., list(SPLIT_HIGH_ORDER)] >> 2).flatten(-2)
    return torch.cat([pack_codes(low, 2), pack_codes(high, 1)], dim=-1)


def _record_from_planes(record: torch.Tensor, layout: Layout, bits: int | None) -> torch.Tensor:
    if bits is None or not layout.split_high_bits(bits):
        return record
    low = unpack_codes(record[..., : layout.high_bits_offset], 2, layout.head_dim).unflatten(-1, (-1, 8))
    high = unpack_codes(record[..., layout.high_bits_offset:], 1, layout.head_dim).unflatten(-1, (-1, 8))
    codes = torch.empty_like(low)
    codes[..., list(SPLIT_LOW_ORDER)] = low
    codes[..., list(SPLIT_HIGH_ORDER)] |= high << 2
    return pack_codes(codes.flatten(-2), 3)


def slots_to_pages(layout: Layout, slots: torch.Tensor) -> torch.Tensor:
    """A "slots" cache [blocks, page, heads, slot_bytes] -> the same data as "planes" [blocks, heads, page_bytes]."""
    blocks, page, heads, slot_bytes = slots.shape
    if (page, slot_bytes) != (layout.page_size, layout.slot_bytes):
        raise ValueError(f"expected slots of a {layout.page_size}-token page, {layout.slot_bytes} bytes each; "
                         f"got shape {tuple(slots.shape)}")
    planes = []
    for _name, start, size in layout.records():
        record = _record_to_planes(slots[..., start: start + size], layout, _code_bits(layout, start))
        planes.append(record.permute(0, 2, 1, 3).reshape(blocks, heads, page * size))
    return torch.cat(planes, dim=-1)


def pages_to_slots(layout: Layout, pages: torch.Tensor) -> torch.Tensor:
    """Inverse of `slots_to_pages`."""
    blocks, heads, page_bytes = pages.shape
    if page_bytes != layout.page_bytes:
        raise ValueError(f"expected pages of {layout.page_bytes} bytes; got shape {tuple(pages.shape)}")
    page = layout.page_size
    records = []
    for _name, start, size in layout.records():
        plane = pages[..., layout.plane_offset(start): layout.plane_offset(start) + page * size]
        record = plane.reshape(blocks, heads, page, size).permute(0, 2, 1, 3)
        records.append(_record_from_planes(record, layout, _code_bits(layout, start)))
    return torch.cat(records, dim=-1)


def as_slots(layout: Layout, kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache in the "slots" layout (a copy for a "planes" cache)."""
    return pages_to_slots(layout, kv_cache) if layout.planes else kv_cache


# --- encoding one slot -------------------------------------------------------
def encode_slots(layout: Layout, key: torch.Tensor, value: torch.Tensor,
                 rotation: torch.Tensor | None, centroids: torch.Tensor | None) -> torch.Tensor:
    """Quantize key/value [..., D] into slot bytes [..., slot_bytes] (uint8)."""
    lead = key.shape[:-1]
    slots = torch.zeros(*lead, layout.slot_bytes, dtype=torch.uint8, device=key.device)
    if layout.key_fp8:
        slots[..., : layout.key_code_bytes] = fp8_e4m3fn_bytes(key)
    else:
        norm, rotated = rotate_keys(key, rotation)
        boundaries = decision_boundaries(centroids.to(key.device))
        codes = (rotated.unsqueeze(-1) >= boundaries).sum(-1)
        slots[..., : layout.key_code_bytes] = pack_codes(codes, layout.key_bits)
        if layout.key_norm_corrected:
            norm = corrected_norm(norm, centroids.to(key.device)[codes])
        off = layout.key_norm_offset
        slots[..., off: off + 2] = _fp16_bytes(norm)
    v = value.to(torch.float32)
    levels = 2**layout.value_bits - 1
    vmin = v.amin(-1)
    vmax = v.amax(-1)
    # Divide by a tensor: torch on CUDA turns division by a Python scalar into a
    # multiplication by its reciprocal, which is not the IEEE division the kernel does.
    scale = torch.clamp_min((vmax - vmin) / torch.full_like(vmax, levels), 1e-8)
    codes = torch.clamp(torch.floor((v - vmin.unsqueeze(-1)) / scale.unsqueeze(-1) + 0.5), 0, levels)
    off = layout.value_code_offset
    slots[..., off: off + layout.value_code_bytes] = pack_codes(codes.to(torch.int64), layout.value_bits)
    slots[..., layout.value_scale_offset: layout.value_scale_offset + 2] = _fp16_bytes(scale)
    slots[..., layout.value_zero_offset: layout.value_zero_offset + 2] = _fp16_bytes(vmin)
    return slots


def corrected_norm(norm: torch.Tensor, centroids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """norm [...] over the norm of each token's centroids [..., D], in fp32 by default as the store
    kernel computes it, at most the largest fp16 (all-zero centroids would overflow: decode would
    compute 0 * inf)."""
    c = centroids.to(dtype)
    return torch.clamp_max(norm.to(dtype) / torch.sqrt((c * c).sum(-1) + 1e-16), 65504.0)


def corrected_key_norms(layout: Layout, slots: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Slot bytes [..., slot_bytes] with plain key norms (docs/format.md's, as "slots" stores them) -> a copy
    with each norm divided by the norm of its token's centroids, as "planes" stores them under
    norm correction (Layout.key_norm_corrected): what `slots_to_pages` needs first to turn a slots
    cache into a valid planes cache of that layout. The fp16 norm is rounded again, so a store into
    planes may differ from this by one unit in the last place. Unchanged where the layout does not
    correct norms."""
    out = slots.clone()
    if not layout.key_norm_corrected:
        return out
    codes = unpack_codes(slots[..., : layout.key_code_bytes], layout.key_bits, layout.head_dim)
    off = layout.key_norm_offset
    norm = _fp16_from_bytes(slots[..., off: off + 2])
    out[..., off: off + 2] = _fp16_bytes(corrected_norm(norm, centroids.to(slots.device)[codes]))
    return out


def store(layout: Layout, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
          slot_mapping: torch.Tensor, rotation: torch.Tensor | None = None,
          centroids: torch.Tensor | None = None) -> None:
    """Write key/value [N, Hkv, D] into kv_cache at slot_mapping [N]; negative slots are skipped."""
    slots = encode_slots(layout, key, value, rotation, centroids)  # [N, Hkv, slot_bytes]
    cache = as_slots(layout, kv_cache)
    page = layout.page_size
    keep = slot_mapping >= 0
    mapping = slot_mapping[keep].to(torch.int64)
    cache[mapping // page, mapping % page] = slots[keep]
    if layout.planes:
        kv_cache.copy_(slots_to_pages(layout, cache))


# --- decoding ----------------------------------------------------------------
def decode_slots(layout: Layout, slots: torch.Tensor, rotation: torch.Tensor | None,
                 centroids: torch.Tensor | None, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot bytes [..., slot_bytes] -> (k_hat, v_hat) [..., D] in the unrotated domain."""
    d = layout.head_dim
    if layout.key_fp8:
        k = slots[..., : layout.key_code_bytes].contiguous().view(torch.float8_e4m3fn).to(dtype)
    else:
        codes = unpack_codes(slots[..., : layout.key_code_bytes], layout.key_bits, d)
        c = centroids.to(device=slots.device, dtype=dtype)[codes]
        if layout.norm_correction_at_decode:  # "planes" stores the corrected norm instead
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        off = layout.key_norm_offset
        norm = _fp16_from_bytes(slots[..., off: off + 2]).to(dtype)
        k = (norm.unsqueeze(-1) * c) @ rotation.to(device=slots.device, dtype=dtype).T
    off = layout.value_code_offset
    vcodes = unpack_codes(slots[..., off: off + layout.value_code_bytes], layout.value_bits, d).to(dtype)
    scale = _fp16_from_bytes(slots[..., layout.value_scale_offset: layout.value_scale_offset + 2]).to(dtype)
    zero = _fp16_from_bytes(slots[..., layout.value_zero_offset: layout.value_zero_offset + 2]).to(dtype)
    v = vcodes * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return k, v


def gather_slots(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The slots of one sequence's first seq_len tokens: [seq_len, Hkv, slot_bytes]."""
    page = kv_cache.shape[1]
    t = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table[t // page].to(torch.int64)
    return kv_cache[blocks, t % page]


def dequantize(layout: Layout, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               rotation: torch.Tensor | None = None, centroids: torch.Tensor | None = None,
               max_len: int | None = None, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, max_len, D]; positions at or past seq_len are zero."""
    kv_cache = as_slots(layout, kv_cache)
    batch = block_table.shape[0]
    hkv, d = kv_cache.shape[2], layout.head_dim
    lens = [int(x) for x in seq_lens.tolist()]
    if max_len is None:
        max_len = max(lens, default=0)
    k_out = torch.zeros(batch, hkv, max_len, d, dtype=dtype, device=kv_cache.device)
    v_out = torch.zeros_like(k_out)
    for b, n in enumerate(lens):
        n = min(n, max_len)
        if n == 0:
            continue
        k, v = decode_slots(layout, gather_slots(kv_cache, block_table[b], n), rotation, centroids, dtype)
        k_out[b, :, :n] = k.transpose(0, 1)
        v_out[b, :, :n] = v.transpose(0, 1)
    return k_out, v_out


def decode(layout: Layout, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, rotation: torch.Tensor | None = None, centroids: torch.Tensor | None = None,
           scale: float | None = None, dtype=torch.float64) -> torch.Tensor:
    """Decode attention [B, Hq, D] for one query token per sequence; seq_len 0 gives zeros."""
    return _decode_slots_cache(layout, query, as_slots(layout, kv_cache), block_table, seq_lens, rotation, centroids,
                               scale, dtype)


def _decode_slots_cache(layout: Layout, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, rotation: torch.Tensor | None, centroids: torch.Tensor | None,
                        scale: float | None, dtype) -> torch.Tensor:
    """`decode` over a cache in the "slots" layout."""
    batch, hq, d = query.shape
    hkv = kv_cache.shape[2]
    group = hq // hkv
    if scale is None:
        scale = d**-0.5
    out = torch.zeros(batch, hq, d, dtype=dtype, device=query.device)
    for b, n in enumerate(int(x) for x in seq_lens.tolist()):
        if n == 0:
            continue
        k, v = decode_slots(layout, gather_slots(kv_cache, block_table[b], n), rotation, centroids, dtype)
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, n, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", query[b].to(dtype), k) * scale
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), v)
    return out


def decode_multi(layout: Layout, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, rotation: torch.Tensor | None = None, centroids: torch.Tensor | None = None,
                 scale: float | None = None, dtype=torch.float64) -> torch.Tensor:
    """Decode attention [B, q_len, Hq, D] for q_len query tokens per sequence, whose keys and values are
    the last q_len of its seq_len cached tokens (speculative decoding's verification): token j attends
    to the positions before seq_len - q_len + 1 + j, i.e. it is `decode` of that token on the sequence
    cut to that length. A token that sees no position (seq_len < q_len) gives zeros."""
    q_len = query.shape[1]
    slots = as_slots(layout, kv_cache)  # once, not per token
    tokens = [_decode_slots_cache(layout, query[:, j], slots, block_table,
                                  (seq_lens.to(torch.int64) - q_len + 1 + j).clamp_min(0), rotation, centroids, scale,
                                  dtype)
              for j in range(q_len)]
    return torch.stack(tokens, dim=1)
