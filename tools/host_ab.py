"""Host time of module.decode built from another checkout against this one's, timed in turn in one process.

    git worktree add /tmp/base HEAD~1   (or: mkdir /tmp/base && git archive HEAD~1 | tar -x -C /tmp/base)
    python3 tools/host_ab.py /tmp/base [CONFIG ...] [--shapes 1x4096 8x4096] [--calls 400]

Between device sessions, and between blocks of calls in one, the host time of the same call moves by tens of
percent on the device machine (docs in tools/host_overhead.py), so a change to the host path is measured here: each
checkout renders its own module of each config (in a subprocess, with a module cache of its own), both are loaded
into this process, and their decode calls with the same launch, workspace and validate=False are timed 10 at a time
in turn (tools/host_overhead.py's interleaved_host_us). The outputs are compared bit for bit. Prints one table:
host us of each and their ratio.
"""

import argparse
import contextlib
import functools
import importlib.util
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout
sys.path.insert(0, HERE)
from host_overhead import DEFAULT_CONFIGS, interleaved_host_us  # noqa: E402  (beside this file)


def module_of(tree: str, config_path: str, cache_dir: str):
    """The decode module `tree`'s tqgen builds for the config (for this machine's GPU), loaded under its own name."""
    code = ("import tqgen; from tqgen import emit; "
            f"print(tqgen.load(emit.as_config({os.path.abspath(config_path)!r})).__file__)")
    env = dict(os.environ, TQGEN_CACHE_DIR=cache_dir, PYTHONPATH=tree)
    path = subprocess.check_output([sys.executable, "-c", code], cwd=tree, env=env, text=True).strip().splitlines()[-1]
    spec = importlib.util.spec_from_file_location(f"host_ab_{abs(hash((tree, path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the other checkout (its tqgen/ and templates/)")
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--shapes", nargs="+", default=["1x4096", "8x4096"])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()

    import torch

    from tqgen import emit, testing

    trees = {"base": os.path.abspath(args.base), "here": HERE}
    print("| decode | batch x context | base host us | here host us | here / base |")
    print("|---|---|---|---|---|")
    for config_path in args.configs:
        config = emit.as_config(config_path)
        modules = {name: module_of(tree, config_path, f"/tmp/tqgen-host-ab-{name}") for name, tree in trees.items()}
        for shape in args.shapes:
            batch, context = (int(part) for part in shape.split("x"))
            problem = testing.random_problem(modules["here"], config, batch, context, 32, 8, "cuda")
            cache, table, lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
            base = modules["base"]
            block_kv, num_warps, num_stages, num_splits = base.decode_launch(batch, 8, 4, context, cache.device)
            launch = dict(block_kv=block_kv, num_warps=num_warps, num_stages=num_stages, num_splits=num_splits)
            if hasattr(base, "query_rotated_in_stage1"):  # where stage 1 may rotate the query: the same choice
                launch["rotate_query"] = base.query_rotated_in_stage1(batch, 4, context, cache.device)
            calls, outs = {}, {}
            for name, module in modules.items():
                outs[name] = torch.empty_like(query)
                workspace = module.DecodeWorkspace(batch, 32, num_splits, "cuda")
                calls[name] = (functools.partial(
                    module.decode, query, cache, table, lens, out=outs[name], workspace=workspace, validate=False,
                    **launch, **testing.codebook_kwargs(module, "cuda")), contextlib.nullcontext)
            host = interleaved_host_us(calls, args.calls)
            if not torch.equal(outs["base"], outs["here"]):
                raise SystemExit(f"{config.name} {shape}: the two modules' outputs differ")
            print(f"| {config.name} | {shape} | {host['base']:.1f} | {host['here']:.1f} | "
                  f"{host['here'] / host['base']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
