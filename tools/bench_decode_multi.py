"""Time decode_multi at q_len 1, 2, 4 and 8 against decode (CUDA-graph replay), 32/8 heads.

    python3 tools/bench_decode_multi.py configs/k3v4-d128-planes.yaml configs/k8v4-d128-planes.yaml [--dot]
        [--shapes 32x8192] [--q-lens 1 2 4 8] [--launches 32:2:8 32:2:6 64:3:4:4 ...] [--wide-caps 168 128]
    python3 tools/bench_decode_multi.py CONFIG:out/ab/main-CONFIG.py CONFIG:out/ab/BRANCH-CONFIG.py ...

Each row: the call's median time, as a multiple of decode's (one query token, its own launch) and against
q_len separate decode calls. Issue 21's targets: q_len 4 <= 1.25x decode, q_len 8 <= 1.6x, q_len 4 >= 3x
faster than 4 calls. --launches times decode_multi at each launch (BLOCK_KV:STAGES:SPLITS[:WARPS]) beside
the one it picks itself ("auto"); --dot also times each q_len with stage 1 held to the tl.dot kernel
(MMA_STAGE1 off: what decode_multi ran before its Gluon kernel); --wide-caps times the Gluon kernel of more
than 8 MMA columns (q_len x heads: 4 x 4 and up) under each register cap in turn (the maxnreg that
`_multi_mma_options` gives it, replaced here; shipped: 168 for the MSE planes presets, none where the grid fits
one wave), decode's own kernel untouched. --wg-columns N lets the warpgroup kernel take programs of N-32 columns
(shipped: 17-32) at the launches that name it (BLOCK_KV:3:SPLITS:4), e.g. q_len 2 x 4 heads at small batches (not
q_len 1, which runs decode's own kernels whatever the launch); the auto launch then stays the one-warp kernel's.
Each launch's output is compared with the auto launch's (max abs difference, printed).
A config given as CONFIG:MODULE.py times that module file (a render of another ref, tools/render_refs.py) on
CONFIG's problems, named by the file: two refs' kernels side by side in one run.
Prints one table at the end.
"""
import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tqgen  # noqa: E402
from tqgen import emit, testing  # noqa: E402


def widen_warpgroup_columns(module, fewest):
    """Let the module's warpgroup kernel (where it has one) take programs of fewest-32 MMA columns (shipped: 17-32)
    at the launches that name it (BLOCK_KV:3:SPLITS:4), or at the auto launch too with --wg-auto."""
    if hasattr(module, "_multi_wg_columns"):
        most = module._WG_MAX_COLUMNS
        module._multi_wg_columns = lambda group_size, q_len: fewest <= q_len * group_size <= most


def parse_launch(text):
    """BLOCK_KV:STAGES:SPLITS[:WARPS] (one warp unless given; 64:3:S:4 is the warpgroup kernel's launch)."""
    block_kv, stages, splits, *warps = (int(part) for part in text.split(":"))
    return dict(block_kv=block_kv, num_stages=stages, num_splits=splits, num_warps=warps[0] if warps else 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--dot", action="store_true", help="also time the tl.dot stage 1")
    parser.add_argument("--shapes", nargs="+", default=["32x8192"], metavar="BATCHxCONTEXT")
    parser.add_argument("--q-lens", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--launches", nargs="+", default=[], metavar="BLOCK_KV:STAGES:SPLITS[:WARPS]",
                        help="also time decode_multi at these launches")
    parser.add_argument("--wide-caps", nargs="+", type=int, default=[], metavar="REGISTERS",
                        help="time the kernel of more than 8 columns under each of these register caps")
    parser.add_argument("--wg-columns", type=int, default=None, metavar="N",
                        help="the warpgroup kernel takes programs of N-32 MMA columns (shipped: 17; 8 with fp8 keys)")
    parser.add_argument("--wg-auto", action="store_true",
                        help="with --wg-columns: the auto launch takes the warpgroup kernel where it can (not the "
                             "one-warp kernel's, the reference otherwise)")
    args = parser.parse_args()
    if args.wg_columns is not None and 1 in args.q_lens:
        parser.error("--wg-columns: q_len 1 runs decode's own kernels whatever the launch; the warpgroup kernel "
                     "takes q_len 2 up (--q-lens 2 ...)")
    launches = [("auto", {})] + [(text, parse_launch(text)) for text in args.launches]
    rows = []
    for entry in args.configs:
        path, _, module_file = entry.partition(":")
        config = emit.as_config(path)
        module = tqgen.load(module_file or config)
        name = Path(module_file).stem if module_file else config.name
        if args.wg_columns is not None:
            widen_warpgroup_columns(module, args.wg_columns)
            if not args.wg_auto:  # the auto launch stays the one-warp kernel's: the reference
                if hasattr(module, "_multi_wg_fewest_programs"):
                    module._multi_wg_fewest_programs = lambda columns: 1 << 30
                module._WG_MIN_PROGRAMS = 1 << 30  # older renders read the constant itself
        # decode_multi's compile options (older renders: decode's, which it used then)
        options_name = "_multi_mma_options" if hasattr(module, "_multi_mma_options") else "_mma_stage1_options"
        shipped_options = getattr(module, options_name)
        caps = [None] + args.wide_caps  # None: the shipped options

        def capped_options(cap):
            def options(block_kv, columns, *one_wave):
                chosen = dict(shipped_options(block_kv, columns, *one_wave))
                if cap is not None and columns > 8:
                    chosen["maxnreg"] = cap
                return chosen
            return options
        for shape in args.shapes:
            batch, context = (int(part) for part in shape.split("x"))
            problem = testing.random_problem(module, config, batch, context, 32, 8, "cuda")
            codebook = testing.codebook_kwargs(module, "cuda")
            q1 = problem["query"]
            ws = module.DecodeWorkspace(batch, 32, 64, "cuda", max_q_len=8)
            out1 = torch.empty_like(q1)

            def single():
                module.decode(q1, problem["cache"], problem["block_table"], problem["seq_lens"], out=out1,
                              workspace=ws, validate=False, max_seq_len=context, **codebook)
            base = triton.testing.do_bench_cudagraph(single, return_mode="median") * 1e3
            picked = module.decode_launch(batch, 8, 4, context, problem["cache"].device)
            print(f"{name} {shape}: decode {base:.1f} us at {picked}", flush=True)
            shipped = getattr(module, "MMA_STAGE1", None)
            paths = [("Gluon", shipped)] + ([("tl.dot", False)] if args.dot and shipped is not None else [])
            for q_len in args.q_lens:
                q = torch.randn(batch, q_len, 32, 128, device="cuda", dtype=q1.dtype)
                out = torch.empty_like(q)
                for label, mma in paths:
                    timed = ([(name, launch, cap) for name, launch in launches for cap in caps] if label == "Gluon"
                             else [launches[0] + (None,)])
                    auto_out = None
                    for launch_name, launch, cap in timed:
                        setattr(module, options_name, capped_options(cap))
                        if cap is not None:
                            launch_name = f"{launch_name} cap {cap}"

                        def multi():
                            module.decode_multi(q, problem["cache"], problem["block_table"], problem["seq_lens"],
                                                out=out, workspace=ws, validate=False, max_seq_len=context,
                                                **launch, **codebook)
                        if mma is not None:
                            module.MMA_STAGE1 = mma
                        us = triton.testing.do_bench_cudagraph(multi, return_mode="median") * 1e3
                        if auto_out is None:
                            auto_out = out.clone()
                        else:
                            launch_name += f" (max |out - auto| {(out - auto_out).abs().max().item():.1e})"
                        row = (name, shape, q_len, f"{label} {launch_name}", us, us / base, q_len * base / us)
                        rows.append(row)
                        print("{} {} q_len {} {}: {:.1f} us = {:.2f}x decode, {:.2f}x faster than q_len calls"
                              .format(*row), flush=True)
                if shipped is not None:
                    module.MMA_STAGE1 = shipped
                setattr(module, options_name, shipped_options)
    print("\n| config | batch x context | q_len | stage 1, launch | us | x decode's time | x faster than q_len "
          "decode calls |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {} | {:.1f} | {:.2f} | {:.2f} |".format(*row))


if __name__ == "__main__":
    main()
