"""Can Gluon express the MMA shapes a hand-laid-out decode would use? Compiled offline for sm90.

    python3 tools/gluon_probe.py

Compiles Sᵀ = K Qᵀ for a 64-token tile (M = 64 tokens, K = 128 head dims, N = 8 padded
heads) with `mma_v2`, operands loaded straight into their dot-operand layouts, and
counts the m16n8k16 MMAs and shared-memory stores in the PTX. No GPU needed; the
result follows the local triton version (see BENCHMARKS.md, "The larger step").
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


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


def main() -> None:
    signature = {"key_ptr": "*fp16", "query_ptr": "*fp16", "out_ptr": "*fp32",
                 "TOKENS": "constexpr", "HEADS": "constexpr", "DIM": "constexpr"}
    source = GluonASTSource(scores_transposed, signature, {"TOKENS": 64, "HEADS": 8, "DIM": 128})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"]
    shapes = sorted({line.split()[0] for line in ptx.splitlines() if "mma.sync" in line})
    print(f"triton {triton.__version__}: {ptx.count('mma.sync')} MMAs {shapes}, "
          f"{ptx.count('st.shared')} shared-memory stores")


if __name__ == "__main__":
    main()
