"""EXPERIMENT: the planes store's 3-bit key codes and norms on the tensor cores, in Gluon (its keys-only form, for 3-
and 4-bit codes, is templates/store/keys_mma.py.jinja, tq_store_keys_mma, on for stores of 4096+ tokens).

    python3 tools/store_keys_mma.py --compile          # no GPU: registers and SASS of each variant (sm90)
    python3 tools/store_keys_mma.py [CONFIG] [--tokens 65536]   # GPU: checked against tq_store, then timed

A program (one warp) takes BLOCK_T tokens of a KV head. Head dim d = 32 t + 16 n3 + 2 a + n0 (a the block, t, n3
and n0 bits of an MMA column): H128 = H8 (x) H16 with the bits placed so, so x @ H128 is an MMA by H16 per block
(keys as the A operand, exact products) and the 8-point transform across blocks as butterflies on the accumulators.
Lane 4 g + t then holds dims 32 t .. 32 t + 31 of its tokens: four whole groups of 8 codes, packed in registers
(no shared memory). COUNT_SQUARES forms the norm correction's sum of centroid squares from popcounts of the code
words' bit products instead of selecting a square per element. tq_store's value path is timed alone beside it
(KEYS=False), to see what a split store (this kernel, then values) would take.

H200, 2026-12-04, k3v4-d128-planes, 65536 tokens x 8 KV heads into shuffled slots, graph replay, one run (this
tool): the shipped tq_store 259.6 us (30.0% of the ceiling for the whole store's bytes); this kernel's keys alone
116.3 us at BLOCK_T 16 with COUNT_SQUARES (125.8 without; 168.3 at 32, whose 229 registers leave 8 warps an SM);
tq_store's value path alone 78.1 us; the two one after the other 194.7 us (1.33x, 40.0%); keys and values in this
kernel (VALUES) 215.6 us (36.1%): at 159 registers, 12 one-warp programs an SM wait on each one's chain. Every
variant's bytes match tq_store's (testing.store_differences 0: codes equal up to boundary ties). Offline (triton
3.6, sm90): 2336 SASS per 16 tokens, keys only (146 warp-instructions a token and head against about 254 for
tq_store's key path), 128 registers; the code search's compares and selects and the predicates they spill (P2R)
are most of it. Also timed and slower: the output columns in two passes of 8 with the 8 A operands built first
(keys 147.9 us, with values 222.9). Not the 70% of issue 25: the key path would have to take about 40 us.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
_MMA_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
_MMA_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))
# [BLOCK_T tokens, 128 dims]: lane 4 g + t holds rows g + 8 i and dims 32 t .. 32 t + 31 (its A elements of every
# block).
_KEY_ROWS = gl.constexpr(gl.BlockedLayout([1, 32], [8, 4], [1, 1], [1, 0]))


@gluon.jit
def _popc(x):
    """Set bits of each int32."""
    return gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _block(x_bits, a: gl.constexpr):
    """Block a of x_bits [BLOCK_T, 4 (t), 2 (k3), 2 (k0), 2 (a2), 2 (a1), 2 (a0)] -> A operand [BLOCK_T, 16] with
    k = 8 k3 + 2 t + k0: each lane already holds its elements, so the splits and reshapes move no data."""
    lo, hi = gl.split(x_bits)  # a0
    if a % 2 == 1:
        lo = hi
    lo, hi = gl.split(lo)  # a1
    if (a // 2) % 2 == 1:
        lo = hi
    lo, hi = gl.split(lo)  # a2
    if a // 4 == 1:
        lo = hi
    part = lo  # [32, 4, 2, 2]: t, k3, k0
    part = gl.reshape(gl.permute(part, [0, 2, 1, 3]), [part.shape[0], 16])
    return gl.convert_layout(part, _MMA_A)


@gluon.jit
def _codes3(y, b0, b1, b2, b3, b4, b5, b6):
    """3-bit codes: the number of sorted decision boundaries b0..b6 at or below y, by binary search."""
    bit2 = y >= b3
    bit1 = y >= gl.where(bit2, b5, b1)
    t0 = gl.where(bit1, b2, b0)
    t1 = gl.where(bit1, b6, b4)
    bit0 = y >= gl.where(bit2, t1, t0)
    return (bit2.to(gl.int32) << 2) | (bit1.to(gl.int32) << 1) | bit0.to(gl.int32)


@gluon.jit
def _square3(code, s0, s1, s2, s3, s4, s5, s6, s7):
    """s[code], selected by the code's bits."""
    bit0 = (code & 1) != 0
    bit1 = (code & 2) != 0
    low = gl.where(bit1, gl.where(bit0, s3, s2), gl.where(bit0, s1, s0))
    high = gl.where(bit1, gl.where(bit0, s7, s6), gl.where(bit0, s5, s4))
    return gl.where((code & 4) != 0, high, low)


@gluon.jit
def _group_word(c0, c1, c2, c3, n0, HIGH: gl.constexpr, STEP0: gl.constexpr, STEP1: gl.constexpr):
    """The column pairs' sum of four blocks' code parts (the high bit, else the low 2 bits), block i shifted to
    n0 + STEP0 (i % 2) + STEP1 (i // 2): one group word's bits in each lane."""
    if HIGH:
        c0, c1, c2, c3 = c0 >> 2, c1 >> 2, c2 >> 2, c3 >> 2
    else:
        c0, c1, c2, c3 = c0 & 3, c1 & 3, c2 & 3, c3 & 3
    return _pair_reduce((c0 << n0) | (c1 << (n0 + STEP0)) | (c2 << (n0 + STEP1)) | (c3 << (n0 + STEP0 + STEP1)))


@gluon.jit
def _pair_reduce(x):
    """[BLOCK_T, 16] (MMA layout) -> [BLOCK_T, 8]: the sum of columns 2 c and 2 c + 1 (one lane holds both)."""
    return gl.sum(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]), axis=2)


@gluon.jit
def tq_store_keys_mma(key_ptr, boundaries_ptr, centroids_ptr, value_ptr, slot_mapping_ptr, cache_ptr, num_tokens,
                      num_slots, stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                      stride_cache_block, stride_cache_head,
                      PAGE_SIZE: gl.constexpr, KEY_CODE_PLANE: gl.constexpr, KEY_CODE_BYTES: gl.constexpr,
                      KEY_HIGH_BITS_AT: gl.constexpr, KEY_NORM_PLANE: gl.constexpr, VALUE_CODE_PLANE: gl.constexpr,
                      VALUE_CODE_BYTES: gl.constexpr, VALUE_SCALE_PLANE: gl.constexpr, BLOCK_T: gl.constexpr,
                      COUNT_SQUARES: gl.constexpr, VALUES: gl.constexpr):
    kv_head = gl.program_id(1)
    first = gl.program_id(0) * BLOCK_T
    # The keys: each lane loads its dims (64 contiguous bytes) of its rows.
    row = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, _KEY_ROWS))
    dim = gl.arange(0, 128, layout=gl.SliceLayout(0, _KEY_ROWS))
    token = first + row
    x = gl.load(key_ptr + token.to(gl.int64)[:, None] * stride_key_token + kv_head * stride_key_head + dim[None, :],
                mask=(token < num_tokens)[:, None], other=0.0)
    if VALUES:  # 4-bit values, loaded before any store (the stores might alias them)
        v = gl.load(value_ptr + token.to(gl.int64)[:, None] * stride_value_token + kv_head * stride_value_head
                    + dim[None, :], mask=(token < num_tokens)[:, None], other=0.0)
    norm = gl.sqrt_rn(gl.sum(x.to(gl.float32) * x.to(gl.float32), axis=1))
    x5 = gl.reshape(x, [BLOCK_T, 4, 2, 2, 2, 2, 2])  # t, k3, a2, a1, a0, k0
    x5 = gl.permute(x5, [0, 1, 2, 6, 3, 4, 5])  # t, k3, k0, a2, a1, a0
    # H16 as the B operand [16, 16]: (k, n) = -1 where k & n has an odd number of set bits.
    hk = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA_B))
    hn = gl.arange(0, 16, layout=gl.SliceLayout(0, _MMA_B))
    both = hk[:, None] & hn[None, :]
    h16 = (1 - 2 * ((both ^ (both >> 1) ^ (both >> 2) ^ (both >> 3)) & 1)).to(key_ptr.dtype.element_ty)
    zero = gl.zeros([BLOCK_T, 16], gl.float32, layout=_MMA)
    y0 = mma_v2(_block(x5, 0), h16, zero)
    y1 = mma_v2(_block(x5, 1), h16, zero)
    y2 = mma_v2(_block(x5, 2), h16, zero)
    y3 = mma_v2(_block(x5, 3), h16, zero)
    y4 = mma_v2(_block(x5, 4), h16, zero)
    y5 = mma_v2(_block(x5, 5), h16, zero)
    y6 = mma_v2(_block(x5, 6), h16, zero)
    y7 = mma_v2(_block(x5, 7), h16, zero)
    # H8 across the blocks: a0, a1, a2.
    y0, y1 = y0 + y1, y0 - y1
    y2, y3 = y2 + y3, y2 - y3
    y4, y5 = y4 + y5, y4 - y5
    y6, y7 = y6 + y7, y6 - y7
    y0, y2 = y0 + y2, y0 - y2
    y1, y3 = y1 + y3, y1 - y3
    y4, y6 = y4 + y6, y4 - y6
    y5, y7 = y5 + y7, y5 - y7
    y0, y4 = y0 + y4, y0 - y4
    y1, y5 = y1 + y5, y1 - y5
    y2, y6 = y2 + y6, y2 - y6
    y3, y7 = y3 + y7, y3 - y7
    unit = gl.convert_layout(0.08838834764831843 / (norm + 1e-8), gl.SliceLayout(1, _MMA))[:, None]
    b0 = gl.load(boundaries_ptr + 0)
    b1 = gl.load(boundaries_ptr + 1)
    b2 = gl.load(boundaries_ptr + 2)
    b3 = gl.load(boundaries_ptr + 3)
    b4 = gl.load(boundaries_ptr + 4)
    b5 = gl.load(boundaries_ptr + 5)
    b6 = gl.load(boundaries_ptr + 6)
    c0 = _codes3(y0 * unit, b0, b1, b2, b3, b4, b5, b6)
    c1 = _codes3(y1 * unit, b0, b1, b2, b3, b4, b5, b6)
    c2 = _codes3(y2 * unit, b0, b1, b2, b3, b4, b5, b6)
    c3 = _codes3(y3 * unit, b0, b1, b2, b3, b4, b5, b6)
    c4 = _codes3(y4 * unit, b0, b1, b2, b3, b4, b5, b6)
    c5 = _codes3(y5 * unit, b0, b1, b2, b3, b4, b5, b6)
    c6 = _codes3(y6 * unit, b0, b1, b2, b3, b4, b5, b6)
    c7 = _codes3(y7 * unit, b0, b1, b2, b3, b4, b5, b6)
    # Norm correction: ||key|| / ||centroids of its codes||.
    q0 = gl.load(centroids_ptr + 0)
    q1 = gl.load(centroids_ptr + 1)
    q2 = gl.load(centroids_ptr + 2)
    q3 = gl.load(centroids_ptr + 3)
    q4 = gl.load(centroids_ptr + 4)
    q5 = gl.load(centroids_ptr + 5)
    q6 = gl.load(centroids_ptr + 6)
    q7 = gl.load(centroids_ptr + 7)
    # Group words: dim 32 t + 16 n3 + 2 a + n0 is code k = n0 + 2 a0 + 4 a1 of group j = 4 t + 2 n3 + a2;
    # its low bits go to 4 (k % 4) + 2 (k // 4) = 4 n0 + 8 a0 + 2 a1, its high bit to 4 n0 + a0 + 2 a1.
    column = gl.arange(0, 16, layout=gl.SliceLayout(0, _MMA))
    n0 = (column & 1)[None, :] * 4
    low_lo = _group_word(c0, c1, c2, c3, n0, False, 8, 2)
    low_hi = _group_word(c4, c5, c6, c7, n0, False, 8, 2)
    high_lo = _group_word(c0, c1, c2, c3, n0, True, 1, 2)
    high_hi = _group_word(c4, c5, c6, c7, n0, True, 1, 2)
    s0, s1, s2, s3, s4, s5, s6, s7 = q0 * q0, q1 * q1, q2 * q2, q3 * q3, q4 * q4, q5 * q5, q6 * q6, q7 * q7
    if COUNT_SQUARES:
        # sum_i s(code_i) from counts of the code bits' products (multilinear in b0, b1, b2): popcounts of the words.
        spread_lo = _group_word(c0, c1, c2, c3, n0, True, 8, 2)
        spread_hi = _group_word(c4, c5, c6, c7, n0, True, 8, 2)
        low = low_lo | (low_hi << 16)
        b2 = spread_lo | (spread_hi << 16)
        b0 = low & 0x55555555
        b1 = (low >> 1) & 0x55555555
        n_b0 = gl.sum(_popc(b0), axis=1)
        n_b1 = gl.sum(_popc(b1), axis=1)
        n_b2 = gl.sum(_popc(b2), axis=1)
        n_b01 = gl.sum(_popc(b0 & b1), axis=1)
        n_b02 = gl.sum(_popc(b0 & b2), axis=1)
        n_b12 = gl.sum(_popc(b1 & b2), axis=1)
        n_b012 = gl.sum(_popc(b0 & b1 & b2), axis=1)
        total = (128.0 * s0 + (s1 - s0) * n_b0.to(gl.float32) + (s2 - s0) * n_b1.to(gl.float32)
                 + (s4 - s0) * n_b2.to(gl.float32) + (s3 - s2 - s1 + s0) * n_b01.to(gl.float32)
                 + (s5 - s4 - s1 + s0) * n_b02.to(gl.float32) + (s6 - s4 - s2 + s0) * n_b12.to(gl.float32)
                 + (s7 - s6 - s5 - s3 + s4 + s2 + s1 - s0) * n_b012.to(gl.float32))
        centroid_norm = gl.sqrt_rn(total + 1e-16)
    else:
        squares = (_square3(c0, s0, s1, s2, s3, s4, s5, s6, s7) + _square3(c1, s0, s1, s2, s3, s4, s5, s6, s7)
                   + _square3(c2, s0, s1, s2, s3, s4, s5, s6, s7) + _square3(c3, s0, s1, s2, s3, s4, s5, s6, s7)
                   + _square3(c4, s0, s1, s2, s3, s4, s5, s6, s7) + _square3(c5, s0, s1, s2, s3, s4, s5, s6, s7)
                   + _square3(c6, s0, s1, s2, s3, s4, s5, s6, s7) + _square3(c7, s0, s1, s2, s3, s4, s5, s6, s7))
        centroid_norm = gl.sqrt_rn(gl.sum(squares, axis=1) + 1e-16)
    # Where each token's record is, carried through the same reshape as the words (so the layouts match).
    mrow = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, _MMA))
    mtoken = first + mrow
    slot = gl.load(slot_mapping_ptr + mtoken, mask=mtoken < num_tokens, other=-1)
    ok = (slot >= 0) & (slot < num_slots)
    page_base = (slot // PAGE_SIZE) * stride_cache_block + kv_head.to(gl.int64) * stride_cache_head
    record = page_base + KEY_CODE_PLANE + (slot % PAGE_SIZE) * KEY_CODE_BYTES
    record2 = _pair_reduce(gl.where(column[None, :] >= 0, record[:, None], 0) * (column[None, :] & 1))
    ok2 = _pair_reduce(gl.where(ok[:, None], 1, 0) * (column[None, :] & 1)) != 0
    group = _pair_reduce((mrow * 0)[:, None] + ((4 * ((column >> 1) & 3) + 2 * (column >> 3)) * (column & 1))[None, :])
    halves = cache_ptr.to(gl.pointer_type(gl.uint16))
    gl.store(halves + (record2 // 2 + group), low_lo.to(gl.uint16), mask=ok2)
    gl.store(halves + (record2 // 2 + group + 1), low_hi.to(gl.uint16), mask=ok2)
    gl.store(cache_ptr + (record2 + KEY_HIGH_BITS_AT + group), high_lo.to(gl.uint8), mask=ok2)
    gl.store(cache_ptr + (record2 + KEY_HIGH_BITS_AT + group + 1), high_hi.to(gl.uint8), mask=ok2)
    stored_norm = gl.minimum(gl.div_rn(norm, gl.convert_layout(centroid_norm, gl.SliceLayout(1, _KEY_ROWS))), 65504.0)
    nslot = gl.convert_layout(slot, gl.SliceLayout(1, _KEY_ROWS))
    nok = (nslot >= 0) & (nslot < num_slots)
    nbase = ((nslot // PAGE_SIZE) * stride_cache_block + kv_head.to(gl.int64) * stride_cache_head + KEY_NORM_PLANE
             + (nslot % PAGE_SIZE) * 2)
    gl.store(halves + nbase // 2, stored_norm.to(gl.float16).to(gl.uint16, bitcast=True), mask=nok)
    if VALUES:
        # As tq_store: scale = max((max - min) / 15, 1e-8), code = floor((v - min) / scale + 0.5) clamped, the
        # division bit for bit IEEE (a refined reciprocal, CUDA's own fast path of div.rn).
        v = v.to(gl.float32)
        value_min = gl.min(v, axis=1)
        value_scale = gl.maximum(gl.div_rn(gl.max(v, axis=1) - value_min, 15.0), 1e-8)
        approximate = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [value_scale],
                                                dtype=gl.float32, is_pure=True, pack=1)
        reciprocal = gl.fma(approximate, gl.fma(-value_scale, approximate, 1.0), approximate)[:, None]
        numerator = v - value_min[:, None]
        quotient = numerator * reciprocal
        quotient = gl.fma(reciprocal, gl.fma(-value_scale[:, None], quotient, numerator), quotient)
        value_codes = gl.minimum(gl.maximum(gl.floor(quotient + 0.5), 0.0), 15.0).to(gl.int32)
        # Group j = dims 8 j .. 8 j + 7 -> one word, code k at bits 4 k: the lane holds whole groups.
        words = gl.sum(gl.reshape(value_codes << ((dim & 7) * 4)[None, :], [BLOCK_T, 16, 8]), axis=2)
        vslot = nslot
        vbase = ((vslot // PAGE_SIZE) * stride_cache_block + kv_head.to(gl.int64) * stride_cache_head
                 + VALUE_CODE_PLANE + (vslot % PAGE_SIZE) * VALUE_CODE_BYTES)
        word_at = gl.max(gl.reshape(vbase[:, None] // 4 + (dim >> 3)[None, :], [BLOCK_T, 16, 8]), axis=2)
        word_ok = gl.max(gl.reshape(gl.where(nok[:, None], 1, 0) + (dim * 0)[None, :], [BLOCK_T, 16, 8]), axis=2) != 0
        gl.store(cache_ptr.to(gl.pointer_type(gl.int32)) + word_at, words, mask=word_ok)
        scale_bits = value_scale.to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
        zero_bits = value_min.to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
        scale_at = ((vslot // PAGE_SIZE) * stride_cache_block + kv_head.to(gl.int64) * stride_cache_head
                    + VALUE_SCALE_PLANE + (vslot % PAGE_SIZE) * 4)
        gl.store(cache_ptr.to(gl.pointer_type(gl.uint32)) + scale_at // 4, scale_bits | (zero_bits << 16), mask=nok)





def store_keys(module, key, kv_cache, slot_mapping, boundaries, centroids, block_t=16, count_squares=True,
               value=None):
    """Key codes and corrected norms of fp16/bf16 keys [num_tokens, num_kv_heads, 128] into a planes cache; and
    with `value` (4-bit values) the values' codes, scales and zeros too (the whole store in one kernel)."""
    num_tokens, num_kv_heads = key.shape[0], key.shape[1]
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    values = key if value is None else value
    tq_store_keys_mma[grid](key, boundaries, centroids, values, slot_mapping, kv_cache, num_tokens,
                            kv_cache.shape[0] * module.PAGE_SIZE, key.stride(0), key.stride(1), values.stride(0),
                            values.stride(1), kv_cache.stride(0), kv_cache.stride(1), PAGE_SIZE=module.PAGE_SIZE,
                            KEY_CODE_PLANE=module.KEY_CODE_PLANE, KEY_CODE_BYTES=module.KEY_CODE_BYTES,
                            KEY_HIGH_BITS_AT=module.KEY_HIGH_BITS_AT, KEY_NORM_PLANE=module.KEY_NORM_PLANE,
                            VALUE_CODE_PLANE=module.VALUE_CODE_PLANE, VALUE_CODE_BYTES=module.VALUE_CODE_BYTES,
                            VALUE_SCALE_PLANE=module.VALUE_SCALE_PLANE, BLOCK_T=block_t,
                            COUNT_SQUARES=count_squares, VALUES=value is not None, num_warps=1)


# BLOCK_T, COUNT_SQUARES, VALUES
VARIANTS = [(16, True, False), (16, False, False), (32, True, False), (16, True, True)]


def compile_report() -> None:
    import ptx_probe  # beside this file
    from triton.experimental.gluon._runtime import GluonASTSource

    types = {"key_ptr": "*fp16", "boundaries_ptr": "*fp32", "centroids_ptr": "*fp32", "value_ptr": "*fp16",
             "slot_mapping_ptr": "*i64", "cache_ptr": "*u8"}
    for block_t, count_squares, values in VARIANTS:
        constants = dict(PAGE_SIZE=16, KEY_CODE_PLANE=0, KEY_CODE_BYTES=48, KEY_HIGH_BITS_AT=32, KEY_NORM_PLANE=768,
                         VALUE_CODE_PLANE=800, VALUE_CODE_BYTES=64, VALUE_SCALE_PLANE=1824, BLOCK_T=block_t,
                         COUNT_SQUARES=count_squares, VALUES=values)
        compiled = ptx_probe._compile_sm90(tq_store_keys_mma, constants, types, ("stride_",), 1, 1, GluonASTSource)
        sass = ptx_probe.sass_count(compiled.asm["cubin"])
        print(f"BLOCK_T {block_t} COUNT_SQUARES {count_squares} VALUES {values} (triton {triton.__version__}, sm90a): "
              f"{ptx_probe.ptxas_usage(compiled.asm['ptx'])}; {sass} SASS; mma.sync x{compiled.asm['ptx'].count('mma.sync')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/k3v4-d128-planes.yaml")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--compile", action="store_true", help="no GPU: compile each variant for sm90")
    args = parser.parse_args()
    if args.compile:
        compile_report()
        return
    import torch

    import tqgen
    from tqgen import bench, config as config_mod, testing

    config = config_mod.load(args.config)
    module = tqgen.load(config)
    if config.cache_layout != "planes" or config.key_bits != 3 or config.head_dim != 128 or config.key_format != "mse":
        raise SystemExit(f"{args.config}: this experiment writes 3-bit MSE keys of head_dim 128 in planes only")
    codebook = testing.codebook_kwargs(module, "cuda")
    centroids = codebook["centroids"]
    boundaries = module.decision_boundaries(centroids).float().contiguous()
    ceiling = bench.copy_ceiling_gbps()
    num_tokens, heads = args.tokens, 8
    key = torch.randn(num_tokens, heads, 128, dtype=torch.float16, device="cuda")
    value = torch.randn_like(key)
    num_blocks = -(-num_tokens // 16)
    slots = torch.randperm(num_blocks * 16, device="cuda")[:num_tokens]
    shipped = module.make_cache(num_blocks, heads, "cuda")
    module.store(key, value, shipped, slots, **codebook)
    nbytes = 2 * key.numel() * key.element_size() + num_tokens * heads * module.SLOT_BYTES

    def graph_us(fn):
        fn()
        return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3

    def values(cache):  # tq_store's value path alone (KEYS=False: the keys are written elsewhere)
        module.tq_store[(triton.cdiv(num_tokens, 8), heads)](
            key, key, boundaries, centroids, value, slots, cache, num_tokens, num_blocks * 16, key.stride(0),
            key.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1), cache.stride(0),
            cache.stride(1), BLOCK_T=8, num_warps=2, KEYS_ROTATED=False, KEYS=False)

    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, {config.name}, {num_tokens} tokens x {heads} "
          f"KV heads, shuffled slots; copy ceiling {ceiling:.0f} GB/s; % of it for the whole store's bytes")
    print("| kernel | us | % of ceiling | bytes differing from tq_store's (ties aside) |")
    print("|---|---|---|---|")
    us = graph_us(lambda: module.store(key, value, shipped, slots, **codebook))
    print(f"| tq_store (shipped) | {us:.1f} | {nbytes / us / 1e3 / ceiling * 100:.1f} | - |")
    us = graph_us(lambda: values(shipped))
    print(f"| tq_store, value path alone | {us:.1f} | - | - |")
    for block_t, count_squares, fused in VARIANTS:
        cache = shipped.clone()
        # Zeroed first: the key codes and norms, and with the values fused, the whole page.
        cache.view(num_blocks, heads, -1)[:, :, : None if fused else module.VALUE_CODE_PLANE] = 0
        run = functools.partial(store_keys, module, key, cache, slots, boundaries, centroids, block_t, count_squares,
                                value if fused else None)
        run()
        differing = testing.store_differences(config, cache, shipped, key, slots, codebook.get("rotation"), centroids)
        name = f"BLOCK_T {block_t}{', counted squares' if count_squares else ''}"
        if fused:
            us = graph_us(run)
            print(f"| keys and values here ({name}) | {us:.1f} | {nbytes / us / 1e3 / ceiling * 100:.1f} | {differing} |")
            continue
        us = graph_us(run)
        both = graph_us(lambda: (run(), values(cache)))
        print(f"| keys here, {name} | {us:.1f} | - | {differing} |")
        print(f"| keys here ({name}) + tq_store's value path | {both:.1f} | {nbytes / both / 1e3 / ceiling * 100:.1f} | - |")


if __name__ == "__main__":
    main()
