"""EXPERIMENT: decode_multi's stage 1 as one warpgroup (4 warps, wgmma) per (sequence, KV head, split).

    python3 tools/warpgroup_multi.py --compile-only           # no GPU: compile for sm90a, print its counts
    python3 tools/warpgroup_multi.py [--shapes 32x8192 8x8192 1x4096] [--q-lens 4 8] [--splits 4 8 16]

docs/limits.md, "What q_len 8 at 1.6x would need": at 4 query heads per KV head, q_len 8 is 32 MMA columns, which
one warp cannot hold, so decode_multi runs two 16-column programs that each decode every tile. Here one program of
4 warps decodes a 64-token tile once for all 32 columns: warp w decodes the keys of page w of the tile (tokens 16w
to 16w + 15, the rows wgmma gives it), scores^T = K Q^T on wgmma with Q^T in shared memory; the columns' max and sum
across the warps; P through shared memory; out^T += V^T P^T on wgmma, warp w holding the head dims of 16-bit value
units 8w..8w + 7 of every token (4 codes a lane and token). Three ways to load a tile (VARIANTS): where used, the
next tile's loads issued before this one is decoded, or a cp.async ring of 3 tiles (warp w copies page w); and the
ring with the lazy max's test as one flag per warp, the columns' exact max exchanged only where a flag is up, and
the value units' token pairs from ldmatrix kept 16 bits wide.
k4v4-d128-planes only (4-bit keys with the symmetric default codebook, 4-bit values, the planes layout); the query
is rotated first by the module's tq_prepare_query and the splits merged by its stage 2.

On the GPU it checks the outputs against the shipped decode_multi's and times, as CUDA-graph replays (median):
decode (q_len 1), the shipped decode_multi and this kernel at each q_len, with this kernel at each split count.
Measured on an H100 (2026-12-06, triton 3.6, one run): docs/limits.md, "What q_len 8 at 1.6x would need"; the
variant "ring 3, flag test" has compiled (triton 3.6 and 3.9) but not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "k4v4-d128-planes.yaml"
# (label, PREFETCH, STAGES, FLAG_TEST): loads where used; the next tile's loads issued first; a cp.async ring of 3
# tiles; the ring with the lazy max's test as a flag per warp (and 16-bit token pairs of value units).
VARIANTS = (("loads", False, 1, False), ("prefetch", True, 1, False), ("ring 3", False, 3, False),
            ("ring 3, flag test", False, 3, True))


def load_module(arch: str | None = None):
    """The k4v4-d128-planes module: built for the current GPU, or rendered for `arch` (offline compiles)."""
    import dataclasses
    import tempfile

    import tqgen
    from tqgen import config as config_mod
    config = config_mod.load(str(CONFIG))
    if arch is None:
        return tqgen.load(config)
    return tqgen.load(dataclasses.replace(config, arch=arch), tempfile.mkdtemp(prefix="tqgen-wg-"))


def define_kernel(module):
    """The warpgroup kernel, its helpers taken from `module` (a k4v4-d128-planes render with Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

    names = ("_mma_key_magnitudes", "_build_byte_table", "_mma_query_dim", "_mma_tile_pages",
             "_byte_perm", "_fp16_halves", "_PAGE_SIZE", "_HEAD_DIM", "_KEY_CODE_BYTES", "_KEY_NORM_PLANE",
             "_VALUE_CODE_PLANE", "_VALUE_CODE_BYTES", "_VALUE_SCALE_PLANE", "_STALE_MAX_SLACK", "_cta_barrier",
             "_RING_PLANE", "_RING_TOKENS", "_async_load", "async_copy")
    namespace = {name: getattr(module, name) for name in names}
    namespace.update(gl=gl, gluon=gluon, fence_async_shared=fence_async_shared, warpgroup_mma=warpgroup_mma)
    namespace["__name__"] = "warpgroup_multi_kernel"  # triton names called jit functions by module
    namespace["_WG_CODEBOOK"] = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
    source = Path(__file__).with_name("warpgroup_multi_kernel.py").read_text()
    exec(compile(source, str(Path(__file__).with_name("warpgroup_multi_kernel.py")), "exec"), namespace)
    return namespace


def tile_layouts(gl, block_kv, page_size):
    """[pages, positions, units] register layouts of a 64-token tile's loads over 4 warps: the keys' 16 group
    words a token (wgmma's A rows: warp w the tokens 16w..16w + 15, i.e. page w at 16-token pages), the values'
    32 16-bit units a token (V^T's A operand: unit 8w + g in warp w, lane 4g + t, tokens 2t + e + 8r)."""
    positions = min(block_kv, page_size)
    assert block_kv == 64, "one warp a 16-token slice of a 64-token tile"

    def token(bit):
        if 1 << bit < positions:
            return [0, 1 << bit, 0]
        return [1 << (bit - positions.bit_length() + 1), 0, 0]

    def unit(step):
        return [0, 0, step]

    shape = [block_kv // positions, positions]
    keys = gl.DistributedLinearLayout(
        reg_bases=[unit(1), unit(2), token(3)], lane_bases=[unit(4), unit(8), token(0), token(1), token(2)],
        warp_bases=[token(4), token(5)], block_bases=[], shape=shape + [16])
    values = gl.DistributedLinearLayout(
        reg_bases=[token(0), token(3), token(4), token(5)], lane_bases=[token(1), token(2), unit(1), unit(2), unit(4)],
        warp_bases=[unit(8), unit(16)], block_bases=[], shape=shape + [32])
    return keys, values


def copy_layouts(gl, keys):
    """The ring's cp.async layouts, 16 bytes a copy, warp w copying page w: key words (the key tile's own layout:
    each lane copies the words it decodes), value units, key norms, value scale-zeros."""
    pages = [[1, 0, 0], [2, 0, 0]]
    values = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 8, 0]],
        lane_bases=[[0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=pages, block_bases=[],
        shape=[4, 16, 32])
    norms = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4]], lane_bases=[[0, 8]] + [[0, 0]] * 4,
                                       warp_bases=[[1, 0], [2, 0]], block_bases=[], shape=[4, 16])
    scales = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]], lane_bases=[[0, 4], [0, 8]] + [[0, 0]] * 3,
                                        warp_bases=[[1, 0], [2, 0]], block_bases=[], shape=[4, 16])
    return (keys, values, norms, scales)


def warp_maxes_layout(gl, block_h):
    """[4, block_h]: the 4 rows (one per warp) in registers, the columns as the wgmma accumulator's columns
    (registers: columns 1, 8, 16..; lanes: columns 2, 4), so that the max over the rows is the columns' max in the
    accumulator's own column layout."""
    columns = [[0, 1]] + [[0, 8 << b] for b in range(max(0, (block_h // 8).bit_length() - 1))]
    return gl.DistributedLinearLayout(reg_bases=columns + [[1, 0], [2, 0]],
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, block_h])


@functools.lru_cache(maxsize=None)
def kernel_constants(page_size, group_size, q_len, prefetch, stages, flag_test):
    """The constexpr arguments of tq_decode_multi_stage1_wg: 64-token tiles, all q_len x group_size columns (at
    least 16), and a variant's (VARIANTS) load and max switches."""
    from triton.experimental.gluon import language as gl
    keys, values = tile_layouts(gl, 64, page_size)
    block_h = max(16, 1 << (q_len * group_size - 1).bit_length())
    positions = min(64, page_size)
    return dict(GROUP_SIZE=group_size, Q_LEN=q_len, BLOCK_H=block_h, BLOCK_KV=64, TILE_PAGES=64 // positions,
                TILE_POSITIONS=positions, KEY_TILE=keys, VALUE_TILE=values, WARP_MAXES=warp_maxes_layout(gl, block_h),
                PREFETCH=prefetch, STAGES=stages, COPIES=copy_layouts(gl, keys), FLAG_TEST=flag_test)


def launch(namespace, module, query, cache, block_table, seq_lens, out, partial_out, partial_lse, prepared,
           rotation, num_splits, variant, scale=None):
    """decode_multi through the warpgroup kernel (a VARIANTS entry's switches): tq_prepare_query, the kernel, the
    module's stage 2."""
    batch, q_len, num_q_heads, dim = query.shape
    num_kv_heads = cache.shape[1]
    scale = dim ** -0.5 if scale is None else scale
    rows = batch * q_len
    module._prepare_query(query.reshape(rows, num_q_heads, dim), rotation, prepared, scale)
    split_capacity = partial_lse.shape[2]
    namespace["tq_decode_multi_stage1_wg"][(batch, num_kv_heads, num_splits)](
        prepared, cache, block_table, seq_lens, module.default_centroids(cache.device), partial_out, partial_lse,
        num_q_heads, cache.shape[0], block_table.shape[1], num_splits, split_capacity,
        q_len * prepared.stride(0), prepared.stride(0), prepared.stride(1),
        cache.stride(0), cache.stride(1), block_table.stride(0),
        **kernel_constants(module.PAGE_SIZE, num_q_heads // num_kv_heads, q_len, *variant[1:]), num_warps=4)
    module._merge_multi_splits(partial_out, partial_lse, out, rows, num_q_heads, num_splits, split_capacity, False)
    return out


def compile_only() -> None:
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, str(REPO / "tools"))
    import ptx_probe
    module = load_module("sm90")
    kernel = define_kernel(module)["tq_decode_multi_stage1_wg"]
    for variant, q_len in [(variant, q_len) for variant in VARIANTS for q_len in (1, 4, 8)]:
        constants = kernel_constants(module.PAGE_SIZE, 4, q_len, *variant[1:])
        # A launch's specializations: pointers and strides divisible by 16.
        compiled = ptx_probe._compile_sm90(kernel, constants, ptx_probe.POINTER_TYPES, ("stride_",), 4, 1,
                                           GluonASTSource)
        ptx = compiled.asm["ptx"]
        print(f"q_len {q_len} ({constants['BLOCK_H']} columns, {variant[0]}): {ptx.count('wgmma.mma_async')} wgmma, "
              f"{ptx.count('bar.sync')} bar.sync, {ptx.count('st.shared')} st.shared, "
              f"{ptx.count('ld.shared')} ld.shared, "
              f"{compiled.metadata.shared} bytes of shared memory; {ptx_probe.ptxas_usage(ptx)}; "
              f"{ptx_probe.sass_count(compiled.asm['cubin'])} SASS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=["32x8192", "8x8192", "1x4096"])
    parser.add_argument("--q-lens", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--splits", nargs="+", type=int, default=[])
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    import torch
    import triton

    from tqgen import emit, testing
    module = load_module()
    config = emit.as_config(str(CONFIG))
    namespace = define_kernel(module)
    device = "cuda"
    rotation = module.default_rotation(device)
    rows = []
    for shape in args.shapes:
        batch, context = (int(part) for part in shape.split("x"))
        problem = testing.random_problem(module, config, batch, context, 32, 8, device)
        cache, table, lens = problem["cache"], problem["block_table"], problem["seq_lens"]
        workspace = module.DecodeWorkspace(batch, 32, 64, device, max_q_len=8)
        query1 = problem["query"]
        out1 = torch.empty_like(query1)
        codebook = testing.codebook_kwargs(module, device)

        def single():
            module.decode(query1, cache, table, lens, out=out1, workspace=workspace, validate=False,
                          max_seq_len=context, **codebook)
        base = triton.testing.do_bench_cudagraph(single, return_mode="median") * 1e3
        decode_splits = module.decode_launch(batch, 8, 4, context, cache.device)[3]
        for q_len in args.q_lens:
            query = torch.randn(batch, q_len, 32, 128, device=device, dtype=torch.float16)
            shipped_out = torch.empty_like(query)

            def shipped():
                module.decode_multi(query, cache, table, lens, out=shipped_out, workspace=workspace,
                                    validate=False, max_seq_len=context, **codebook)
            shipped_us = triton.testing.do_bench_cudagraph(shipped, return_mode="median") * 1e3
            rows.append((shape, q_len, "shipped", "auto", shipped_us, shipped_us / base, "-"))
            print(rows[-1], flush=True)
            launches = [(splits, variant) for splits in args.splits or [decode_splits] for variant in VARIANTS]
            for splits, variant in launches:
                out = torch.empty_like(query)
                partial_out = torch.empty(batch * q_len, 32, splits, 128, device=device, dtype=torch.float32)
                partial_lse = torch.empty(batch * q_len, 32, splits, device=device, dtype=torch.float32)
                prepared = torch.empty(batch * q_len, 32, 128, device=device, dtype=torch.float16)

                def warpgroup():
                    launch(namespace, module, query, cache, table, lens, out, partial_out, partial_lse, prepared,
                           rotation, splits, variant)
                warpgroup()
                torch.cuda.synchronize()
                error = testing.relative_error(out.float(), shipped_out.float())
                us = triton.testing.do_bench_cudagraph(warpgroup, return_mode="median") * 1e3
                rows.append((shape, q_len, f"warpgroup, {variant[0]}", splits, us, us / base, f"{error:.1e}"))
                print(rows[-1], flush=True)
        print(f"{shape}: decode {base:.1f} us (splits {decode_splits})", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, triton {triton.__version__}, k4v4-d128-planes, 32/8 heads, graph replay")
    print("| batch x context | q_len | stage 1 | splits | us | x decode | relative error vs shipped |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {} | {:.1f} | {:.2f} | {} |".format(*row))


if __name__ == "__main__":
    main()
