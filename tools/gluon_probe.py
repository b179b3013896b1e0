"""Can Gluon express the shapes a hand-laid-out decode would use? Compiled offline for sm90.

    python3 tools/gluon_probe.py

1. Sᵀ = K Qᵀ for a 64-token tile (M = 64 tokens, K = 128 head dims, N = 8 padded heads) with `mma_v2`,
   operands loaded straight into their dot-operand layouts: the m16n8k16 MMAs and shared-memory stores
   in the PTX.
2. One-warp programs side by side in one CTA (docs/limits.md, "Small batches"): `gl.warp_specialize` with
   four one-warp worker partitions, each an `mma_v2` tile in the one-warp layouts of the decode kernels,
   leaving its result in shared memory and arriving on an mbarrier, and the default partition (which must
   be a multiple of 4 warps) merging the four after the region. Triton 3.6 and 3.9 compile it (8 warps a
   CTA, setmaxnreg per partition). The decode built this way ran as the split_warps variants of stage 1
   (slower, docs/limits.md "Small batches"; removed since, their code at commit 627aebf).
3. One warpgroup over a 64-token tile and 32 MMA columns (docs/limits.md, "What q_len 8 at 1.6x would need"):
   `warpgroup_mma` with the keys and V^T as register A operands (a stand-in for the decode), Q^T and P in
   shared memory, an online softmax over the columns across the 4 warps; and the A operand's register layout
   per warp beside mma_v2's (printed by the compiler: the same bases, the warps tiling the rows).

No GPU needed; the result follows the local triton version.
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
_MMA_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
_MMA_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))
_MERGE = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0]))  # the default partition's 4 warps
_SLOTS = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # gl.barrier in newer triton, thread_barrier in 3.6


@gluon.jit
def scores_transposed(key_ptr, query_ptr, out_ptr, TOKENS: gl.constexpr, HEADS: gl.constexpr, DIM: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    key_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    query_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, key_layout))
    dims = gl.arange(0, DIM, layout=gl.SliceLayout(0, key_layout))
    keys = gl.load(key_ptr + tokens[:, None] * DIM + dims[None, :])
    query_dims = gl.arange(0, DIM, layout=gl.SliceLayout(1, query_layout))
    heads = gl.arange(0, HEADS, layout=gl.SliceLayout(0, query_layout))
    query_t = gl.load(query_ptr + heads[None, :] * DIM + query_dims[:, None])
    scores_t = mma_v2(keys, query_t, gl.zeros([TOKENS, HEADS], gl.float32, layout=mma))
    rows = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + rows[:, None] * HEADS + cols[None, :], scores_t)


@gluon.jit
def _partition_tile(key_ptr, query_ptr, partials, done, PART: gl.constexpr):
    """Worker PART (one warp): softmax numerators of its 16 keys' scores [16, 8], into slot PART."""
    tokens = PART * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA_A))
    dims = gl.arange(0, 128, layout=gl.SliceLayout(0, _MMA_A))
    keys = gl.load(key_ptr + gl.program_id(0) * 64 * 128 + tokens[:, None] * 128 + dims[None, :])
    query_dims = gl.arange(0, 128, layout=gl.SliceLayout(1, _MMA_B))
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA_B))
    query = gl.load(query_ptr + heads[None, :] * 128 + query_dims[:, None])
    scores = mma_v2(keys, query, gl.zeros([16, 8], gl.float32, layout=_MMA))
    partials.index(PART).store(gl.exp2(scores - gl.max(scores, axis=0)[None, :]))
    mbarrier.arrive(done, count=1)


@gluon.jit
def _partition_idle():
    pass


@gluon.jit
def partitions_merged(key_ptr, query_ptr, out_ptr):
    partials = gl.allocate_shared_memory(gl.float32, [4, 16, 8], _SLOTS)
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done, count=4)
    gl.warp_specialize([(_partition_idle, ()),
                        (_partition_tile, (key_ptr, query_ptr, partials, done, 0)),
                        (_partition_tile, (key_ptr, query_ptr, partials, done, 1)),
                        (_partition_tile, (key_ptr, query_ptr, partials, done, 2)),
                        (_partition_tile, (key_ptr, query_ptr, partials, done, 3))],
                       [1, 1, 1, 1], [128, 128, 128, 128])
    mbarrier.wait(done, 0)
    merged = partials.index(0).load(_MERGE) + partials.index(1).load(_MERGE) + partials.index(2).load(_MERGE) \
        + partials.index(3).load(_MERGE)
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, _MERGE))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, _MERGE))
    gl.store(out_ptr + gl.program_id(0) * 128 + rows[:, None] * 8 + cols[None, :], merged)
    mbarrier.invalidate(done)


@gluon.jit
def warpgroup_tile(key_ptr, value_ptr, query_ptr, out_ptr, TILES: gl.constexpr):
    """out^T [128 head dims, 32 columns] over TILES tiles of 64 tokens, 4 warps: scores^T = K Q^T and
    out^T += V^T P^T on wgmma, K and V^T decoded (here: masked codes) straight into the A operand's registers."""
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
    a_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    loads: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    operand_b: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    dims = gl.arange(0, 128, layout=gl.SliceLayout(1, loads))
    columns = gl.arange(0, 32, layout=gl.SliceLayout(0, loads))
    query_t = gl.allocate_shared_memory(gl.float16, [128, 32], operand_b,
                                        gl.load(query_ptr + columns[None, :] * 128 + dims[:, None]))
    probabilities = gl.allocate_shared_memory(gl.float16, [64, 32], operand_b)
    fence_async_shared()
    key_tokens = gl.arange(0, 64, layout=gl.SliceLayout(1, a_operand))
    key_dims = gl.arange(0, 128, layout=gl.SliceLayout(0, a_operand))
    value_dims = gl.arange(0, 128, layout=gl.SliceLayout(1, a_operand))
    value_tokens = gl.arange(0, 64, layout=gl.SliceLayout(0, a_operand))
    running_max = gl.full([32], -float("inf"), gl.float32, layout=gl.SliceLayout(0, acc))
    running_sum = gl.zeros([32], gl.float32, layout=gl.SliceLayout(0, acc))
    out_t = gl.zeros([128, 32], gl.float32, layout=acc)
    for tile in range(TILES):
        codes = gl.load(key_ptr + tile * 8192 + key_tokens[:, None] * 128 + key_dims[None, :])
        scores_t = warpgroup_mma((codes.to(gl.int32) & 7).to(gl.float16), query_t,
                                 gl.zeros([64, 32], gl.float32, layout=acc))
        new_max = gl.maximum(running_max, gl.max(scores_t, axis=0))  # across the 4 warps' tokens
        numerators = gl.exp2(scores_t - new_max[None, :])
        rescale = gl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + gl.sum(numerators, axis=0)
        running_max = new_max
        _cta_barrier()  # the previous tile's MMA has read P
        probabilities.store(numerators.to(gl.float16))
        fence_async_shared()
        codes = gl.load(value_ptr + tile * 8192 + value_tokens[None, :] * 128 + value_dims[:, None])
        out_t = warpgroup_mma((codes.to(gl.int32) & 15).to(gl.float16), probabilities, out_t * rescale[None, :])
    out_t = out_t / running_sum[None, :]
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, acc))
    cols = gl.arange(0, 32, layout=gl.SliceLayout(0, acc))
    gl.store(out_ptr + cols[None, :] * 128 + rows[:, None], out_t)


@gluon.jit
def a_operand_layouts():
    """The compiler prints wgmma's A operand layout over 64 rows (4 warps) and mma_v2's over 16 (one warp)."""
    wgmma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
    gl.static_print("wgmma A:", gl.to_linear_layout(gl.DotOperandLayout(operand_index=0, parent=wgmma, k_width=2),
                                                    [64, 128]))
    gl.static_print("mma_v2 A:", gl.to_linear_layout(_MMA_A, [16, 128]))


def main() -> None:
    signature = {"key_ptr": "*fp16", "query_ptr": "*fp16", "out_ptr": "*fp32",
                 "TOKENS": "constexpr", "HEADS": "constexpr", "DIM": "constexpr"}
    source = GluonASTSource(scores_transposed, signature, {"TOKENS": 64, "HEADS": 8, "DIM": 128})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"]
    shapes = sorted({line.split()[0] for line in ptx.splitlines() if "mma.sync" in line})
    print(f"triton {triton.__version__}: {ptx.count('mma.sync')} MMAs {shapes}, "
          f"{ptx.count('st.shared')} shared-memory stores")
    signature = {"key_ptr": "*fp16", "query_ptr": "*fp16", "out_ptr": "*fp32"}
    compiled = triton.compile(GluonASTSource(partitions_merged, signature, {}), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    print(f"warp_specialize, four one-warp MMA partitions: {compiled.metadata.num_warps} warps, "
          f"{ptx.count('mma.sync')} mma.sync and {ptx.count('setmaxnreg')} setmaxnreg lines in the PTX")
    signature = {"key_ptr": "*u8", "value_ptr": "*u8", "query_ptr": "*fp16", "out_ptr": "*fp32", "TILES": "constexpr"}
    aligned = {(index,): [["tt.divisibility", 16]] for index in range(4)}
    compiled = triton.compile(GluonASTSource(warpgroup_tile, signature, {"TILES": 4}, aligned),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    print(f"one warpgroup, 64 tokens x 32 columns a tile: {ptx.count('wgmma.mma_async')} wgmma, "
          f"{ptx.count('bar.sync')} bar.sync, {compiled.metadata.shared} bytes of shared memory")
    triton.compile(GluonASTSource(a_operand_layouts, {}, {}), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))


if __name__ == "__main__":
    main()
