"""Decode over the same data in both cache layouts ("slots" and "planes"), on the GPU.

    python3 tools/compare_layouts.py [--presets k3v4 k8v4] [--shapes 32x8192]
        [--launches 1:32:1 1:32:3 ...] [--splits 4 8]

For each preset (configs/PRESET-d128.yaml and configs/PRESET-d128-planes.yaml)
and shape, a random slots cache is built once and re-laid into planes with
`reference.slots_to_pages` (after `reference.corrected_key_norms`: planes stores the key norms
norm-corrected). Each layout's module is timed over the launches
(warps:block_kv:stages) x splits, as CUDA-graph replays against the copy
ceiling of the same run. The script prints the best launches of each layout
and the relative difference between the two layouts' outputs.
"""

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tqgen  # noqa: E402
from tqgen import bench, config as config_mod, reference, testing  # noqa: E402
from tqgen.layout import Layout  # noqa: E402
from tqgen.testing import codebook_kwargs  # noqa: E402

FIELDS = ("num_warps", "block_kv", "num_stages")


def sweep(module, problem, cache, workspace, context, launches, splits):
    """[(ms, label, launch)] sorted fastest first; launches that fail to compile are reported and skipped."""
    out = torch.empty_like(problem["query"])

    def call(**launch):
        return module.decode(problem["query"], cache, problem["block_table"], problem["seq_lens"], out=out,
                             workspace=workspace, validate=False, max_seq_len=context, **launch)

    results = []
    for launch in launches:
        for num_splits in splits:
            full = dict(launch, num_splits=num_splits)
            try:
                call(**full)
                ms = triton.testing.do_bench_cudagraph(lambda: call(**full), return_mode="median")
            except Exception as exc:  # a launch the compiler rejects is a result, not a stop
                print(f"  failed {full}: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                continue
            label = f"w{full['num_warps']} kv{full['block_kv']} st{full['num_stages']} sp{num_splits}"
            results.append((ms, label, full))
    results.sort(key=lambda row: row[0])
    return results, call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["k3v4", "k8v4"])
    parser.add_argument("--shapes", nargs="+", default=["32x8192"])
    parser.add_argument("--launches", nargs="+", default=["1:32:1", "1:32:2", "1:32:3", "1:64:1", "1:64:2", "2:64:1"])
    parser.add_argument("--splits", nargs="+", type=int, default=[4, 8])
    args = parser.parse_args()
    launches = [dict(zip(FIELDS, map(int, text.split(":")))) for text in args.launches]
    ceiling = bench.copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    for preset in args.presets:
        slots = config_mod.resolve_arch(config_mod.load(f"configs/{preset}-d128.yaml"))
        planes = config_mod.resolve_arch(config_mod.load(f"configs/{preset}-d128-planes.yaml"))
        slots_module, planes_module = tqgen.load(slots), tqgen.load(planes)
        centroids = codebook_kwargs(planes_module, "cuda").get("centroids")  # fp8 keys: none
        for shape in args.shapes:
            batch, context = map(int, shape.split("x"))
            problem = testing.random_problem(slots_module, slots, batch, context, 32, 8, "cuda")
            # A block at a time: the reference unpacks codes to int64.
            planes_layout = Layout.from_config(planes)
            planes_cache = torch.cat([reference.slots_to_pages(planes_layout,
                                                               reference.corrected_key_norms(planes_layout, blocks,
                                                                                             centroids))
                                      for blocks in problem["cache"].split(1024)])
            caches = {"slots": problem["cache"], "planes": planes_cache}
            workspace = slots_module.DecodeWorkspace(batch, 32, max(args.splits), "cuda")
            nbytes = batch * 8 * context * slots_module.SLOT_BYTES
            outputs = {}
            for name, module in (("slots", slots_module), ("planes", planes_module)):
                results, call = sweep(module, problem, caches[name], workspace, context, launches, args.splits)
                if not results:
                    print(f"{preset} {name} {shape}: no launch ran", flush=True)
                    continue
                shown = ", ".join(f"{ms * 1e3:.1f} us {label} ({100 * nbytes / (ms * 1e-3) / 1e9 / ceiling:.1f}%)"
                                  for ms, label, _ in results[:4])
                print(f"{preset} {name} {shape}: {shown} | slowest {results[-1][0] * 1e3:.0f} us {results[-1][1]}",
                      flush=True)
                outputs[name] = call(**results[0][2]).float().clone()
            if len(outputs) == 2:
                difference = ((outputs["planes"] - outputs["slots"]).norm() / outputs["slots"].norm()).item()
                print(f"  planes vs slots output (best launches): relative difference {difference:.2e}", flush=True)


if __name__ == "__main__":
    main()
