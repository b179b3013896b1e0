"""Two or more rendered modules of one config, their decode calls timed side by side on the GPU (A/B).

    python3 tools/ab_modules.py CONFIG OLD.py NEW.py [...] [--shapes 32x16384 8x8192]
                                [--launches 32:2:8 64:2:16 ...] [--q-heads 32] [--rotate-query stage1|prepare]
                                [--merge-in-stage1]

Each module file is a rendering of CONFIG for the GPU's arch (of other git refs: `python3 tools/render_refs.py
CONFIG main BRANCH`, then carry out/ab to the GPU machine). Every module decodes the same random full-length problem (32 query / 8
KV heads unless --q-heads) at each launch (BLOCK_KV:STAGES:SPLITS, one warp; default: the first module's
tuned or heuristic launch), as a whole call in CUDA-graph replay (median), with the copy ceiling measured in
the same run; outputs must agree with the first module's to fp16 rounding (the last column). Planes MSE
modules choose where the query is rotated from their own tuned files unless --rotate-query pins it (stage1: in
stage 1; prepare: tq_prepare_query first): a module whose tuned files are stale takes the heuristic's choice,
so pin it when comparing such a module at batch <= 8; modules without that choice (fp8 keys) ignore it.
--merge-in-stage1 times each module twice, its splits merged by stage 2 and then by stage 1 itself (decode's
merge_in_stage1; one module: the two ways side by side). Each row times the modules --rounds times (default 2), in
order and then in reverse order, and takes each module's median over the rounds (timed once each, in order, modules
that run the same instructions read 1.05-1.07x in the first row of each table: H100, 2026-12-07, docs/limits.md
"Small batches"); the last column is the first module's spread over its rounds (slowest / fastest), which says how
far to trust a ratio. Prints one table: what a change to the kernels buys, before any re-tune (one module: its
launches side by side).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timing_orders(modules: int, rounds: int) -> list[list[int]]:
    """The order the modules are timed in, each round: as given, then reversed, alternating, so that no module is
    always the first (or last) timed of a row."""
    return [list(range(modules)) if r % 2 == 0 else list(range(modules))[::-1] for r in range(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("modules", nargs="+")
    parser.add_argument("--shapes", nargs="+", default=["32x16384", "8x8192"])
    parser.add_argument("--launches", nargs="+", default=[], metavar="BLOCK_KV:STAGES:SPLITS")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--rotate-query", choices=["stage1", "prepare"],
                        help="pin where planes MSE modules rotate the query (default: each module's own choice)")
    parser.add_argument("--merge-in-stage1", action="store_true",
                        help="time each module with its splits merged by stage 2, then by stage 1 itself")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timings of each module a row, alternating the order (default 2); each its median")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")

    import torch
    import triton

    from tqgen import bench, config as config_mod, emit, testing
    from tqgen.tuned_files import LAUNCH_FIELDS

    config = config_mod.resolve_arch(config_mod.load(args.config), None)
    modules = [(os.path.basename(path), emit.import_module_file(path), {}) for path in args.modules]
    if args.merge_in_stage1:
        modules = [(f"{name} {label}", module, dict(merge_in_stage1=merge)) for name, module, _ in modules
                   for label, merge in (("stage 2", False), ("merged", True))]
    ceiling = bench.copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s on {torch.cuda.get_device_name()}, triton {triton.__version__}; "
          f"{args.q_heads} query / 8 KV heads, graph replay")
    ratios = [f"{name} / {modules[0][0]}" for name, _, _ in modules[1:]]
    print("| batch x context | launch | " + " | ".join([f"{name} us" for name, _, _ in modules] + ratios)
          + " | % of ceiling (last) | max error against the first | spread of the first |")
    print("|---|---|" + "---|" * (2 * len(modules) + 2))
    first = modules[0][1]
    for shape in args.shapes:
        batch, context = (int(part) for part in shape.split("x"))
        problem = testing.random_problem(first, config, batch, context, args.q_heads, 8, "cuda")
        group = args.q_heads // 8
        if args.launches:
            launches = [dict(zip(("block_kv", "num_stages", "num_splits"), map(int, text.split(":"))), num_warps=1)
                        for text in args.launches]
        else:
            launches = [dict(zip(LAUNCH_FIELDS, first.decode_launch(batch, 8, group, context, problem["cache"].device)))]
        workspace = first.DecodeWorkspace(batch, args.q_heads, max([64] + [launch["num_splits"] for launch in launches]),
                                          "cuda")
        rotation = {} if args.rotate_query is None else dict(rotate_query=args.rotate_query == "stage1")
        for launch in launches:
            calls, outputs = [], []
            for _, module, merge in modules:
                out = torch.empty_like(problem["query"])

                # Each module's own codebook tensors: a planes MSE module rotates the query in stage 1 only with its
                # own default rotation (the very tensor), and takes another module's for a caller's matrix.
                codebook = testing.codebook_kwargs(module, "cuda")

                # Only modules with the choice take --rotate-query (fp8 keys are stored unrotated: no such keyword).
                pinned = rotation if "rotate_query" in inspect.signature(module.decode).parameters else {}

                def call(module=module, out=out, codebook=codebook, merge=merge, pinned=pinned):
                    module.decode(problem["query"], problem["cache"], problem["block_table"], problem["seq_lens"],
                                  out=out, workspace=workspace, validate=False, **launch, **pinned, **merge,
                                  **codebook)
                call()
                torch.cuda.synchronize()
                outputs.append(out.float().clone())
                calls.append(call)
            rounds = [[] for _ in calls]  # each module's median of each round, us
            for order in timing_orders(len(calls), args.rounds):
                for index in order:
                    rounds[index].append(triton.testing.do_bench_cudagraph(calls[index], return_mode="median") * 1e3)
            times = [statistics.median(each) for each in rounds]
            nbytes = batch * 8 * context * first.SLOT_BYTES
            percent = 100 * nbytes / (times[-1] * 1e-6) / 1e9 / ceiling
            error = max(float((o - outputs[0]).abs().max()) for o in outputs)
            text = f"kv{launch['block_kv']} st{launch['num_stages']} sp{launch['num_splits']}"
            cells = [f"{t:.1f}" for t in times] + [f"{t / times[0]:.3f}" for t in times[1:]]
            spread = max(rounds[0]) / min(rounds[0])
            print(f"| {batch} x {context} | {text} | " + " | ".join(cells)
                  + f" | {percent:.1f} | {error:.1e} | {spread:.3f} |", flush=True)
        del problem


if __name__ == "__main__":
    main()
