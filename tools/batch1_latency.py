"""Where batch-1 decode time goes: launches, one program's latency, tiles per split.

    python3 tools/batch1_latency.py [CONFIG...] [--contexts 64 1024 4096]

Prints, each as a CUDA-graph replay on the current GPU:
- an empty Triton kernel, and two in a row (what a launch costs inside a graph);
- for each config and context at batch 1 (32 query / 8 KV heads): the whole decode call at a few
  launches, with 1 split (one program walks every tile: time per tile) and with one split per
  64 tokens (every program has one tile: the latency of one program); for the MSE presets both
  with the config's rotation (applied in stage 1) and with an equal copy of it (which takes
  tq_prepare_query and, where it exists, the Gluon kernel).

    python3 tools/batch1_latency.py CONFIG... --kernels 1x1024x16 1x4096x64 4x1024x16 ...

instead times each BATCHxCONTEXTxSPLITS call (32-token tiles, 1 stage, a 16-bit query, the bucket's
rotation choice) as a graph replay with dependent launches on and off, and each kernel's own duration
(torch.profiler, dependent launches off, so that no kernel's time includes waiting for the one before).
"""

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tqgen  # noqa: E402
from tqgen import config as config_mod, testing  # noqa: E402

DEFAULT_CONFIGS = ["configs/k8v4-d128-planes.yaml", "configs/k3v4-d128-planes.yaml", "configs/k4v4-d128-planes.yaml"]
LAUNCHES = [(64, 1, 1), (64, 2, 1), (32, 1, 2), (64, 1, 2)]  # (block_kv, num_warps, num_stages)


@triton.jit
def _empty(x_ptr):
    pass


def graph_us(fn):
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def kernel_us(fn, calls=50):
    """Each decode kernel's mean duration over `calls` calls, in us (torch.profiler's CUDA activity)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    durations = {}
    for event in profile.key_averages():
        if event.key.startswith("tq_"):  # device_time: torch >= 2.4 (cuda_time before, deprecated since)
            durations[event.key] = event.device_time if hasattr(event, "device_time") else event.cuda_time
    return durations


def kernel_durations(path, cases):
    """Per (batch, context, splits): the call as a graph replay with and without dependent launches, and
    each kernel's duration without them."""
    config = config_mod.load(path)
    module = tqgen.load(config)
    codebook = testing.codebook_kwargs(module, "cuda")
    for batch, context, num_splits in cases:
        problem = testing.random_problem(module, config, batch, context, 32, 8, "cuda")
        out = torch.empty_like(problem["query"])
        workspace = module.DecodeWorkspace(batch, 32, num_splits, "cuda")

        def call():
            module.decode(problem["query"], problem["cache"], problem["block_table"], problem["seq_lens"],
                          out=out, workspace=workspace, validate=False, num_splits=num_splits, block_kv=32,
                          num_warps=1, num_stages=1, **codebook)
        dependent = graph_us(call)
        shipped_rule = module._dependent_launch
        module._dependent_launch = lambda device: False
        try:
            independent = graph_us(call)
            kernels = kernel_us(call)
        finally:
            module._dependent_launch = shipped_rule
        durations = ", ".join(f"{name} {us:.2f}" for name, us in sorted(kernels.items()))
        print(f"{config.name} {batch}x{context} sp{num_splits}: graph {dependent:.2f} us "
              f"({independent:.2f} without dependent launches); kernels: {durations}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[64, 1024, 4096])
    parser.add_argument("--kernels", nargs="+", metavar="BxTxS", help="per-kernel durations of these calls")
    args = parser.parse_args()
    if args.kernels:
        for path in args.configs:
            kernel_durations(path, [tuple(map(int, case.split("x"))) for case in args.kernels])
        return
    x = torch.zeros(1, device="cuda")
    print(f"empty kernel: {graph_us(lambda: _empty[(1,)](x)):.2f} us; "
          f"two: {graph_us(lambda: (_empty[(1,)](x), _empty[(1,)](x))):.2f} us")
    for path in args.configs:
        config = config_mod.load(path)
        module = tqgen.load(config)
        codebook = testing.codebook_kwargs(module, "cuda")
        variants = {"": codebook}
        if "rotation" in codebook:
            variants = {"rotating in stage 1": codebook,
                        "tq_prepare_query first": dict(codebook, rotation=codebook["rotation"].clone())}
        for context in args.contexts:
            problem = testing.random_problem(module, config, 1, context, 32, 8, "cuda")
            out = torch.empty_like(problem["query"])
            workspace = module.DecodeWorkspace(1, 32, 64, "cuda")
            for label, kwargs in variants.items():
                for block_kv, num_warps, num_stages in LAUNCHES:
                    for num_splits in sorted({1, max(1, context // 64)}):
                        def call():
                            module.decode(problem["query"], problem["cache"], problem["block_table"],
                                          problem["seq_lens"], out=out, workspace=workspace, validate=False,
                                          num_splits=num_splits, block_kv=block_kv, num_warps=num_warps,
                                          num_stages=num_stages, **kwargs)
                        print(f"{config.name} 1x{context} {label} kv{block_kv}_w{num_warps}_st{num_stages} "
                              f"sp{num_splits}: {graph_us(call):.2f} us", flush=True)


if __name__ == "__main__":
    main()
