"""How many warp-instructions of each kind an SM of this GPU completes per nanosecond: the pipes the Gluon stage 1
spends its time in (byte permutes, logic ops, shifts, integer multiply-adds, fp32 and fp16x2 fused multiply-adds).

    python3 tools/pipe_rates.py            # GPU: one table
    python3 tools/pipe_rates.py --compile  # no GPU: compile each kernel for sm90 and print its loop's SASS mix

Each kernel runs 16 four-warp programs per SM; every thread keeps 8 independent chains and each loop pass issues 32
instructions of the kind (an inline-asm block, so neither compiler drops or merges them), or of two kinds in
turn ("prmt+imad"). The rate is warp-instructions per ns per SM; the last column puts it against fp32 FFMA, which
the FMA pipes take at one warp-instruction per cycle per scheduler. Mixed pairs show whether two kinds run on
different pipes: a pair faster than either kind alone does.
"""

from __future__ import annotations

import argparse
import os
import sys

import triton
import triton.language as tl

# One instruction of each kind; {d} is the chain's register, {n} the next chain's, {s} one more operand.
KINDS = {
    "prmt": "prmt.b32 {d}, {d}, {n}, {s};",
    "lop3": "lop3.b32 {d}, {d}, {n}, {s}, 0x96;",
    "shf": "shf.r.wrap.b32 {d}, {d}, {n}, {s};",
    "imad": "mad.lo.u32 {d}, {d}, {n}, {s};",
    "imad.hi": "mad.hi.u32 {d}, {d}, {n}, {s};",
    "ffma": "fma.rn.f32 {d}, {d}, {n}, {s};",
    "hfma2": "fma.rn.f16x2 {d}, {d}, {n}, {s};",
}
MIXES = ("prmt+lop3", "prmt+imad", "prmt+imad.hi")
CHAINS, REPEATS = 8, 4
PROGRAMS_PER_SM, WARPS = 16, 4


def asm_text(kind: str) -> str:
    """The loop body's asm: CHAINS * REPEATS instructions of `kind` (a mix alternates its two kinds)."""
    first, _, second = kind.partition("+")
    lines = []
    for _ in range(REPEATS):
        for chain in range(CHAINS):
            name = second if second and chain % 2 else first
            lines.append(KINDS[name].format(d=f"${chain}", n=f"${(chain + 1) % CHAINS}", s=f"${CHAINS}"))
    return " ".join(lines)


@triton.jit
def _pipe_kernel(out_ptr, iterations, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, FLOAT: tl.constexpr):
    offsets = tl.program_id(0) * 128 + tl.arange(0, 128)
    if FLOAT:
        start = offsets.to(tl.float32) * 1e-3
        extra = start * 0 + 0.999
    else:
        start = offsets
        extra = start * 0 + 0x3210
    r = (start, start + 1, start + 2, start + 3, start + 4, start + 5, start + 6, start + 7)
    for _ in range(iterations):
        r = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], extra],
                                      dtype=(start.dtype, ) * 8, is_pure=True, pack=1)
    tl.store(out_ptr + offsets, (r[0] + r[1] + r[2] + r[3] + r[4] + r[5] + r[6] + r[7]).to(tl.float32))


def launch_arguments(kind: str) -> dict:
    """The constexpr arguments of one kind's kernel."""
    floating = kind == "ffma"
    register = "f" if floating else "r"
    constraints = ",".join([f"={register}"] * CHAINS + [str(chain) for chain in range(CHAINS)] + [register])
    return dict(ASM=asm_text(kind), CONSTRAINTS=constraints, FLOAT=floating)


def compile_report() -> None:
    """Each kernel compiled for sm90 offline: its loop's SASS mix (that the asm became what it says)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ptx_probe  # beside this file

    for kind in (*KINDS, *MIXES):
        arguments = launch_arguments(kind)
        source = ASTSource(_pipe_kernel, {"out_ptr": "*fp32", "iterations": "i32", **dict.fromkeys(arguments,
                                                                                                  "constexpr")},
                           arguments)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=WARPS))
        print(f"{kind}: {ptx_probe.loop_mix(ptx_probe.disassemble(compiled.asm['cubin']))}")


def time_rates(iterations: int = 2000) -> dict[str, float]:
    """Warp-instructions per ns per SM of each kind and mix, timed on the current GPU."""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * PROGRAMS_PER_SM
    out = torch.empty(programs * 128, device="cuda", dtype=torch.float32)
    rates = {}
    for kind in (*KINDS, *MIXES):
        arguments = launch_arguments(kind)

        def run(arguments=arguments):
            _pipe_kernel[(programs,)](out, iterations, num_warps=WARPS, **arguments)

        run()
        torch.cuda.synchronize()
        milliseconds = triton.testing.do_bench(run, warmup=5, rep=50)
        rates[kind] = programs * WARPS * iterations * CHAINS * REPEATS / (milliseconds * 1e6) / sms
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="no GPU: the SASS mix of each kernel's loop")
    args = parser.parse_args()
    if args.compile:
        compile_report()
        return
    import torch

    rates = time_rates()
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}: {WARPS * PROGRAMS_PER_SM} warps per SM, "
          f"{CHAINS} independent chains per thread")
    print("| instructions | warp-instructions per ns per SM | x fp32 FFMA |")
    print("|---|---|---|")
    for kind, rate in rates.items():
        print(f"| {kind} | {rate:.2f} | {rate / rates['ffma']:.2f} |")


if __name__ == "__main__":
    main()
