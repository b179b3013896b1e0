"""Register caps of the Gluon stage 1 side by side: fewer registers, more programs per SM.

    python3 tools/stage1_register_caps.py [--configs configs/k3v4-d128-planes.yaml ...]
                                          [--shapes 32x16384 8x8192] [--caps 120 104 96 88] [--stages 1 2]
                                          [--splits 16] [--rotate-query stage1|prepare]

Times a whole decode call (CUDA-graph replay, 32-token tiles, --splits splits, one warp) for each register
cap (the maxnreg that `_mma_stage1_options` gives the kernel, replaced here; 0: no cap) and each ring depth,
with the copy ceiling measured in the same run. A slots config's cache is laid out as vLLM and make_cache
allocate it (head-major), as the tuner times it. Each cap's output is compared with the first cap's: a cap changes only
the register allocation, so they must agree (the last column). Prints one table. Registers are allocated
per warp in units of 8 per lane, and a scheduler holds 64 KB of them: up to 128 a lane, 4 one-warp programs
per scheduler fit; from 129 to 168, 3. --rotate-query pins where a module that can rotate the query in stage 1
does so (stage1: stage 1 itself, whose transform adds registers; prepare: tq_prepare_query first; default: the
module's own choice for the shape).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/k3v4-d128-planes.yaml", "configs/k3v3-d128-planes.yaml"])
    parser.add_argument("--shapes", nargs="+", default=["32x16384", "8x8192"])
    parser.add_argument("--caps", nargs="+", type=int, default=[120, 104, 96, 88], help="0: no cap")
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--splits", type=int, default=16)
    parser.add_argument("--q-heads", type=int, default=32, help="query heads (8 KV heads): 128 for 16 per KV head")
    parser.add_argument("--rotate-query", choices=["stage1", "prepare"],
                        help="pin where the query is rotated (modules whose stage 1 can rotate it)")
    args = parser.parse_args()

    import torch
    import triton

    import tqgen
    from tqgen import bench, config as config_mod, testing

    ceiling = bench.copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s on {torch.cuda.get_device_name()}; {args.q_heads} query / 8 KV heads, "
          f"graph replay; query rotated by {args.rotate_query or 'each module as it chooses'}")
    print("| config | batch x context | stages | register cap | us | % of ceiling | error against the first cap |")
    print("|---|---|---|---|---|---|---|")
    for path in args.configs:
        config = config_mod.resolve_arch(config_mod.load(path))
        module = tqgen.load(config, tempfile.mkdtemp(prefix="tqgen-caps-"))
        rotation = {}
        if args.rotate_query and hasattr(module, "query_rotated_in_stage1"):
            rotation = dict(rotate_query=args.rotate_query == "stage1")
        for shape in args.shapes:
            batch, context = map(int, shape.split("x"))
            problem = testing.random_problem(module, config, batch, context, args.q_heads, 8, "cuda")
            codebook = testing.codebook_kwargs(module, "cuda")
            out = torch.empty_like(problem["query"])
            workspace = module.DecodeWorkspace(batch, args.q_heads, 64, "cuda")
            nbytes = batch * 8 * context * module.SLOT_BYTES
            for stages in args.stages:
                first = None
                for cap in args.caps:
                    options = dict(num_warps=1, maxnreg=cap) if cap else dict(num_warps=1)
                    module._mma_stage1_options = lambda block_kv, group_size=4, options=options: options
                    module._mma_stage1_keywords.cache_clear()  # decode's launch keywords, built once per launch

                    def call(stages=stages):
                        module.decode(problem["query"], problem["cache"], problem["block_table"], problem["seq_lens"],
                                      out=out, workspace=workspace, validate=False, block_kv=32, num_warps=1,
                                      num_stages=stages, num_splits=args.splits, **rotation, **codebook)

                    call()
                    torch.cuda.synchronize()
                    error = 0.0 if first is None else testing.relative_error(out, first)
                    first = out.clone() if first is None else first
                    us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
                    print(f"| {config.name} | {batch} x {context} | {stages} | {cap or 'none'} | {us:.1f} | "
                          f"{100 * nbytes / (us * 1e-6) / 1e9 / ceiling:.1f} | {error:.1e} |", flush=True)
            del problem


if __name__ == "__main__":
    main()
