"""Where the Gluon stage 1's time goes: the shipped kernel beside experiment variants of itself.

    python3 tools/stage1_variants.py [--configs configs/k3v4-d128-planes.yaml ...] [--shapes 32x16384 8x8192]
                                     [--variants load_only compute_only ...] [--block-kv 32] [--compile-only]

The variants are rendered by the templates themselves (`render(config, stage1_variant=...)`,
plan.STAGE1_VARIANTS), not by editing rendered text:
- shipped:      the kernel as modules carry it;
- load_only:    every global load of the loop (block ids, key words, key norms, value scales and
                zeros, value words), nothing else: the words are XOR-folded into registers and the
                fold goes to the output once per program, so no load can be dropped;
- compute_only: every decode step, MMA and softmax of the loop, no load in it: block ids are the page
                numbers, and words, norms, scales and zeros are made from their addresses in registers;
- extra_alu, extra_fma: the shipped kernel with 80 more instructions per tile (plan.EXTRA_WORK_CHAINS independent
                chains), all lop3 (the integer pipe) or all fp32 fma (the FMA pipes): the same count either way, so
                the two times say which pipe the kernel's time follows, and each against shipped what one more
                instruction per tile costs;
(Variants measured, lost and removed: plan.py names them; their code is at commit 627aebf.)
Each is timed as a whole decode call (CUDA-graph replay, the shipped launch of the shape, the same random
cache), with the copy ceiling measured in the same run: load_only and compute_only with their words loaded
where used (num_stages 1), the others with the launch's stages; the first column times the shipped launch as
it is (with the cp.async ring where the tuned or heuristic launch has num_stages >= 2). The compute-only time
bounds what the instructions cost; the load-only time what the bytes cost at the occupancy the kernel has; if
the shipped time is near their sum, loads and compute do not overlap.
--compile-only compiles each variant offline for sm90 (no GPU) and prints registers and SASS counts.
--write-modules DIR writes each variant's module, rendered for sm90, as DIR/ARTIFACT_VARIANT.py, for
tools/ab_modules.py to time at launches of its choice.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqgen import config as config_mod, emit, render  # noqa: E402
from tqgen.plan import STAGE1_VARIANTS  # noqa: E402
from tqgen.tuned_files import LAUNCH_FIELDS  # noqa: E402


def variant_modules(config, folder, variants=STAGE1_VARIANTS):
    """(variant, imported module) for each stage-1 variant of one config."""
    out = []
    for variant in variants:
        path = os.path.join(folder, f"{config.artifact_name()}_{variant}.py")
        with open(path, "w") as handle:
            handle.write(render.render(config, stage1_variant=variant))
        out.append((variant, emit.import_module_file(path)))
    return out


def compile_only(configs) -> None:
    import ptx_probe  # beside this file

    for config in configs:
        for variant, module in variant_modules(config, tempfile.mkdtemp(prefix="tqgen-variants-")):
            compiled = ptx_probe.compile_stage1_mma(module, 32)
            ptx = compiled.asm["ptx"]
            print(f"{config.name} {variant}: {ptx_probe.ptxas_usage(ptx)}; {ptx_probe.sass_count(compiled.asm['cubin'])} "
                  f"SASS, ld.global x{ptx.count('ld.global')}, mma x{ptx.count('mma.sync')}", flush=True)


# The variants without a ring (their loads are where they are used, or gone); the others run the launch's stages.
ONE_STAGE_VARIANTS = ("load_only", "compute_only")


def _stages_label(variant):
    return "1 stage" if variant in ONE_STAGE_VARIANTS else "the launch's stages"


def time_variants(configs, shapes, variants=STAGE1_VARIANTS, block_kv=None) -> None:
    """Time each config's variants (`variants` starts with "shipped") at each shape; block_kv replaces the
    launch's tile size."""
    import torch
    import triton

    from tqgen import bench, testing

    ceiling = bench.copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s on {torch.cuda.get_device_name()}; 32 query / 8 KV heads, graph replay")
    print("| config | batch x context | launch | shipped launch us | "
          + " | ".join(f"{v} us ({_stages_label(v)})" for v in variants)
          + " | shipped % of ceiling | " + " | ".join(f"{v} / shipped" for v in variants if v != "shipped") + " |")
    print("|---|---|---|---|" + "---|" * (2 * len(variants)))
    for config in configs:
        modules = variant_modules(config, tempfile.mkdtemp(prefix="tqgen-variants-"), variants)
        shipped = modules[0][1]
        for batch, context in shapes:
            problem = testing.random_problem(shipped, config, batch, context, 32, 8, "cuda")
            launch = dict(zip(LAUNCH_FIELDS, shipped.decode_launch(batch, 8, 4, context, problem["cache"].device)))
            if block_kv:
                launch["block_kv"] = block_kv
            out = torch.empty_like(problem["query"])
            workspace = shipped.DecodeWorkspace(batch, 32, 64, "cuda")
            times = {}
            runs = [("launch", shipped, launch["num_stages"])] + [
                (v, m, 1 if v in ONE_STAGE_VARIANTS else launch["num_stages"]) for v, m in modules]
            for variant, module, stages in runs:
                print(f"  {config.name} {batch} x {context}: {variant}", file=sys.stderr, flush=True)
                # Each module's own codebook tensors: stage 1 rotates the query only with its module's own rotation.
                codebook = testing.codebook_kwargs(module, "cuda")

                def call(module=module, stages=stages, codebook=codebook):
                    module.decode(problem["query"], problem["cache"], problem["block_table"], problem["seq_lens"],
                                  out=out, workspace=workspace, validate=False, **{**launch, "num_stages": stages},
                                  **codebook)
                call()
                torch.cuda.synchronize()  # a failing variant is named here, not at a later call
                times[variant] = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
            nbytes = batch * 8 * context * shipped.SLOT_BYTES
            percent = {v: 100 * nbytes / (t * 1e-6) / 1e9 / ceiling for v, t in times.items()}
            print(f"| {config.name} | {batch} x {context} | kv{launch['block_kv']} st{launch['num_stages']} "
                  f"sp{launch['num_splits']} | {times['launch']:.1f} | "
                  + " | ".join(f"{times[v]:.1f}" for v in variants)
                  + f" | {percent['shipped']:.1f} | "
                  + " | ".join(f"{times[v] / times['shipped']:.2f}" for v in variants if v != "shipped") + " |",
                  flush=True)
            del problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/k3v4-d128-planes.yaml", "configs/k3v3-d128-planes.yaml"])
    parser.add_argument("--shapes", nargs="+", default=["32x16384", "8x8192"])
    parser.add_argument("--variants", nargs="+", default=list(STAGE1_VARIANTS), choices=STAGE1_VARIANTS,
                        help="which variants to time (shipped is always timed)")
    parser.add_argument("--block-kv", type=int, help="tile size for every run (default: the launch's)")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--write-modules", metavar="DIR", help="write the variants' modules (sm90) and stop")
    args = parser.parse_args()
    capability = (9, 0) if args.compile_only or args.write_modules else None
    configs = [config_mod.resolve_arch(config_mod.load(path), capability) for path in args.configs]
    if args.write_modules:
        os.makedirs(args.write_modules, exist_ok=True)
        variants = ["shipped"] + [v for v in args.variants if v != "shipped"]
        for config in configs:
            for variant in variants:
                path = os.path.join(args.write_modules, f"{config.artifact_name()}_{variant}.py")
                with open(path, "w") as handle:
                    handle.write(render.render(config, stage1_variant=variant))
                print(path)
    elif args.compile_only:
        compile_only(configs)
    else:
        variants = ["shipped"] + [v for v in args.variants if v != "shipped"]
        time_variants(configs, [tuple(map(int, shape.split("x"))) for shape in args.shapes], variants, args.block_kv)


if __name__ == "__main__":
    main()
