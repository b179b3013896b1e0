"""Where batch-1 decode time goes: launches, one program's latency, tiles per split.

    python3 tools/batch1_latency.py [CONFIG...] [--contexts 64 1024 4096]

Prints, each as a CUDA-graph replay on the current GPU:
- an empty Triton kernel, and two in a row (what a launch costs inside a graph);
- for each config and context at batch 1 (32 query / 8 KV heads): the whole decode call at a few
  launches, with 1 split (one program walks every tile: time per tile) and with one split per
  64 tokens (every program has one tile: the latency of one program); for the MSE presets both
  with the config's rotation (applied in stage 1) and with an equal copy of it (which takes
  tq_prepare_query and, where it exists, the Gluon kernel).
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--contexts", nargs="+", type=int, default=[64, 1024, 4096])
    args = parser.parse_args()
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
