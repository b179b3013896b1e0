"""Store launches timed side by side on the GPU, against the copy ceiling of the same run.

    python3 tools/ablate_store.py CONFIG [CONFIG ...] [--module OLD.py ...] [--launch 16:4 ...]
                                  [--tokens 32 65536]

For each config, the store of N fp16 (key, value) tokens with 8 KV heads is timed as a
CUDA-graph replay, for each launch (block_t:num_warps) and for each --module (a module
rendered from an older commit, timed with its own default launch), in two slot patterns:
- scattered: a random permutation of the cache's slots (what `tqgen bench` times);
- prefill:   consecutive positions within randomly ordered pages (a prompt being cached).
Bytes = fp16 read + slots written, as in `tqgen bench`. Before timing, each launch's
cache is compared with the reference's (tqgen.testing.store_differences) on the
scattered pattern at the smallest --tokens. For Hadamard MSE configs, the "torch-rotated"
rows pass a copy of the rotation, which makes the launcher rotate the keys with torch
(the path of any other matrix) instead of the kernel's Walsh-Hadamard transform.
--variants times edited kernels at the first launch (wrong bytes on purpose: they measure
what the dropped work costs):
- nofwht:   no Walsh-Hadamard transform (the unit key is coded unrotated)
- nocodes:  no key codes (the codebook comparisons and the key code stores dropped)
- nosearch: no code search (codes from one multiply; packing and code stores kept)
"""

import argparse
import os
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tqgen import bench, config as config_mod, emit, reference, render  # noqa: E402
from tqgen.layout import Layout  # noqa: E402
from tqgen.testing import codebook_kwargs, store_differences  # noqa: E402

from ablate_stage1 import import_source  # noqa: E402  (beside this file)

NUM_KV_HEADS = 8
VARIANTS = {
    "nofwht": ("_walsh_hadamard(key) * (", "key * ("),
    "nocodes": ("    _store_key_codes(cache_ptr, ", "    pass  # _store_key_codes(cache_ptr, "),
    "nosearch": ("token_mask, codes)\n    _store_fp16", "token_mask, (rotated * 4.0).to(tl.int32) & 7)\n    _store_fp16"),
}


def slot_patterns(num_tokens: int, page: int, device) -> dict:
    num_blocks = -(-num_tokens // page)
    pages = torch.randperm(num_blocks, device=device)
    position = torch.arange(num_tokens, device=device)
    return {
        "scattered": torch.randperm(num_blocks * page, device=device)[:num_tokens],
        "prefill": pages[position // page] * page + position % page,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--module", nargs="*", default=[], help="older module files, matched to a config by name")
    parser.add_argument("--launch", nargs="+", default=["16:4", "8:4", "32:4", "16:8"], help="block_t:num_warps")
    parser.add_argument("--tokens", nargs="+", type=int, default=[32, 65536])
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    args = parser.parse_args()
    device = "cuda"
    ceiling = bench.copy_ceiling_gbps(device)
    print(f"copy ceiling {ceiling:.0f} GB/s; {NUM_KV_HEADS} KV heads; graph replay")
    print("| config | module | launch | tokens | pattern | us | % of ceiling |")
    print("|---|---|---|---|---|---|---|")
    folder = tempfile.mkdtemp(prefix="tqgen-ablate-store-")
    for path in args.configs:
        config = config_mod.resolve_arch(config_mod.load(path), torch.cuda.get_device_capability())
        module = emit.load(config, os.environ.get("TQGEN_CACHE_DIR", "/tmp/tqgen-ablate-store"))
        runs = [("new", module, dict(block_t=int(t), num_warps=int(w)))
                for t, w in (launch.split(":") for launch in args.launch)]
        if config.key_format == "mse" and config.rotation == "hadamard":
            runs.append(("torch-rotated", module, dict(rotation=module.default_rotation(device).clone())))
        first = dict(zip(("block_t", "num_warps"), map(int, args.launch[0].split(":"))))
        source = render.render(config) if args.variants else ""
        for name in args.variants:
            old, new = VARIANTS[name]
            if old not in source:
                raise SystemExit(f"variant {name!r} does not apply to {config.name}")
            tag = f"{config.name}_{name}".replace("-", "_")
            runs.append((name, import_source(source.replace(old, new), tag, folder), first))
        # Named by folder too: modules of one config rendered at two commits (old/NAME.py, new/NAME.py) side by side.
        runs += [(os.path.join(os.path.basename(os.path.dirname(os.path.abspath(m))), os.path.basename(m)),
                  emit.import_module_file(m), {}) for m in args.module
                 if os.path.basename(m).removesuffix(".py") == config.name]
        codebook = codebook_kwargs(module, device)
        for tokens in args.tokens:
            key = torch.randn(tokens, NUM_KV_HEADS, config.head_dim, dtype=torch.float16, device=device)
            value = torch.randn_like(key)
            num_blocks = -(-tokens // config.block_size)
            nbytes = 2 * key.numel() * key.element_size() + tokens * NUM_KV_HEADS * module.SLOT_BYTES
            patterns = slot_patterns(tokens, config.block_size, device)
            if tokens == min(args.tokens):
                expected = module.make_cache(num_blocks, NUM_KV_HEADS, device)
                reference.store(Layout.from_config(config), key, value, expected, patterns["scattered"],
                                codebook.get("rotation"), codebook.get("centroids"))
            for name, mod, launch in runs:
                cache = mod.make_cache(num_blocks, NUM_KV_HEADS, device)
                if tokens == min(args.tokens):
                    mod.store(key, value, cache, patterns["scattered"], **{**codebook_kwargs(mod, device), **launch})
                    differing = store_differences(config, cache, expected, key, patterns["scattered"],
                                                  codebook.get("rotation"), codebook.get("centroids"))
                    if differing and name not in VARIANTS:
                        print(f"| {config.name} | {name} | {launch} | {tokens} | WRONG: {differing} bytes differ | | |")
                        continue
                for pattern, slots in patterns.items():
                    def call():
                        mod.store(key, value, cache, slots, validate=False, **{**codebook_kwargs(mod, device), **launch})

                    call()
                    ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
                    shown = ":".join(str(v) for v in launch.values() if isinstance(v, int)) or "default"
                    print(f"| {config.name} | {name} | {shown} | {tokens} | {pattern} | {ms * 1e3:.1f} | "
                          f"{100 * nbytes / (ms * 1e-3) / 1e9 / ceiling:.1f} |", flush=True)


if __name__ == "__main__":
    main()
