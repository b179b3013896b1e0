"""The decode stage-1 kernels of a planes config with the Gluon kernel, timed side by side on the GPU.

    python3 tools/compare_stage1.py CONFIG... [--shapes 1x4096 2x4096 8x8192 ...]
                                    [--block-kv 32 64] [--splits 8 16 32 64] [--stages 1 3]

For each shape, the whole decode call (CUDA-graph replay) with
- mma: the Gluon kernel on mma.sync, after tq_prepare_query (3 kernels);
- dot-rotating: the tl.dot kernel rotating the query itself (2 kernels; default rotation only);
- dot: the tl.dot kernel after tq_prepare_query (3 kernels),
(fp8 keys need no query preparation: mma and dot, 2 kernels each)
each at its best launch over the given tiles, splits and (tl.dot only) stages, one warp. The
module's switches pick the path: MMA_STAGE1, and _ROTATE_QUERY_MAX_BATCH (0: never rotate in
stage 1; 8: up to 8 sequences). The last column says which path wins: what decode's dispatch
(_ROTATE_QUERY_MAX_BATCH) should follow.
"""

import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tqgen  # noqa: E402
from tqgen import bench, config as config_mod, testing  # noqa: E402

PATHS = {"mma": (True, 0), "dot-rotating": (False, 8), "dot": (False, 0)}  # MMA_STAGE1, _ROTATE_QUERY_MAX_BATCH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--shapes", nargs="+", default=["1x4096", "2x4096", "4x4096", "8x4096", "8x8192", "32x16384"])
    parser.add_argument("--block-kv", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--splits", nargs="+", type=int, default=[8, 16, 32, 64])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 3])
    args = parser.parse_args()
    ceiling = bench.copy_ceiling_gbps()
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, copy ceiling {ceiling:.0f} GB/s", flush=True)
    rows = ["| config | shape | mma us (launch) | dot-rotating us (launch) | dot us (launch) | fastest |",
            "|---|---|---|---|---|---|"]
    for path in args.configs:
        config = config_mod.resolve_arch(config_mod.load(path))
        module = tqgen.load(config)
        if not hasattr(module, "tq_decode_stage1_mma"):
            raise SystemExit(f"{path} has no Gluon stage 1 (Plan.mma_stage1)")
        rotates = hasattr(module, "_ROTATE_QUERY_MAX_BATCH")  # MSE keys at head_dim 128, default rotation
        saved = module.MMA_STAGE1, getattr(module, "_ROTATE_QUERY_MAX_BATCH", 0)
        for shape in args.shapes:
            batch, context = map(int, shape.split("x"))
            problem = testing.random_problem(module, config, batch, context, 32, 8, "cuda")
            inputs = [problem[k] for k in ("query", "cache", "block_table", "seq_lens")]
            out = torch.empty_like(problem["query"])
            workspace = module.DecodeWorkspace(batch, 32, max(args.splits), "cuda")
            best = {}
            for name, (mma, rotate_batch) in PATHS.items():
                if name == "dot-rotating" and (batch > rotate_batch or not rotates):
                    continue
                module.MMA_STAGE1 = mma
                if rotates:
                    module._ROTATE_QUERY_MAX_BATCH = rotate_batch
                stages = [1] if mma else args.stages
                for block_kv, splits, num_stages in itertools.product(args.block_kv, args.splits, stages):
                    launch = dict(block_kv=block_kv, num_splits=splits, num_warps=1, num_stages=num_stages)

                    def call(launch=launch):
                        module.decode(*inputs, out=out, workspace=workspace, validate=False, max_seq_len=context,
                                      **launch)

                    call()
                    us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
                    if name not in best or us < best[name][0]:
                        best[name] = (us, f"kv{block_kv} sp{splits}" + ("" if mma else f" st{num_stages}"))
            module.MMA_STAGE1 = saved[0]
            if rotates:
                module._ROTATE_QUERY_MAX_BATCH = saved[1]
            cells = [f"{best[n][0]:.1f} ({best[n][1]})" if n in best else "-" for n in PATHS]
            rows.append(f"| {config.name} | {shape} | " + " | ".join(cells) + f" | {min(best, key=lambda n: best[n][0])} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
