"""The `tqgen` command line: a thin layer over config, render, emit, tuner and testing.

Errors a user can cause print one line, `tqgen: error: ...`, and exit 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from .buckets import DEFAULT_BATCHES, DEFAULT_CONTEXTS, DEFAULT_GROUP_SIZES, DEFAULT_KV_HEADS
from .errors import TqgenError
from .files import make_folder, write_failure_reason

EXIT_USAGE = 2
EXIT_FAILED = 1


def _cmd_build(args: argparse.Namespace) -> int:
    from . import config as config_mod

    # Validate every config before writing any, and before importing torch (slow to import).
    configs = [config_mod.load(path) for path in args.configs]
    _refuse_clashes(args.configs, configs, Path(args.output))
    from . import emit

    tuned_dir = emit.tuned_dir_to_read(args.tuned_dir)
    for path, config in zip(args.configs, configs):
        built = emit.build_files(config, args.output, tuned_dir)
        if not built.variants:
            print(f"{path} -> {built.path} (tuned launches: {_tuned_devices(built.tuned)})")
            continue
        print(f"{path} -> {built.path} (arch auto: each call runs the variant for its device's arch)")
        for variant in built.variants:
            print(f"  {variant.arch:6s} {variant.path}  tuned launches: {_tuned_devices(variant.tuned)}")
    return 0


def _refuse_clashes(paths: list, configs: list, out: Path) -> None:
    """Refuse in one line two configs that would write one file with different bytes (an arch-auto config's
    variant and an explicit-arch config of its format under another name, say): the later would replace the
    earlier's file, and a dispatcher refuses a variant it was not built with. Equal configs write equal bytes."""
    import dataclasses

    from .config import KNOWN_ARCHES

    writers: dict[str, tuple[str, object]] = {}
    for path, config in zip(paths, configs):
        # What build_files writes: the module, or the dispatcher and one module per arch, each as its config gives it.
        written = [config] + ([dataclasses.replace(config, arch=arch) for arch in KNOWN_ARCHES]
                              if config.arch == "auto" else [])
        for file_config in written:
            name = f"{file_config.artifact_name()}.py"
            first_path, first = writers.setdefault(name, (path, file_config))
            if first != file_config:
                differ = [field for field, value in first.to_dict().items() if file_config.to_dict()[field] != value]
                raise TqgenError(f"{first_path} and {path} both write {out / name}, differently (they differ in "
                                 f"{', '.join(differ)}): build them into different folders")


def _tuned_devices(tuned: dict) -> str:
    if not tuned:
        return "none (heuristic)"
    return ", ".join(f"{device} ({len(entry['buckets'])} buckets)" for device, entry in sorted(tuned.items()))


def _cmd_render(args: argparse.Namespace) -> int:
    from . import emit, render

    sys.stdout.write(render.render(emit.as_config(args.config)))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from . import config as config_mod
    from . import dispatch, emit, render

    # arch auto: what `tqgen build` writes, a dispatcher over one module per arch (whatever GPU is here).
    shown = config_mod.load(args.config)
    root = emit.tuned_dir_to_read(args.tuned_dir)  # before anything is printed
    variants = dispatch.variant_configs(shown) if shown.arch == "auto" else []
    print(f"config      {args.config}")
    for key, value in shown.to_dict().items():
        print(f"  {key:16s}{value}")
    if variants:
        print(f"artifact    {shown.artifact_name()}.py: each call runs the variant for its device's arch "
              f"(arch auto), one module each: {', '.join(v.arch for v in variants)}")
    else:
        print(f"artifact    {shown.artifact_name()}.py")
    print(f"config hash {shown.hash()}")
    print(f"templates   {render.template_hash()}  ({render.template_dir()})")
    if not variants:
        print(f"decode      {render.decode_kernel_hash(shown)}  (kernel hash: tuned launches are valid for it)")
    _show_layout(shown)
    current = _current_gpu()
    if not variants:
        _show_tuned(shown, root, current)
        return 0
    for variant in variants:
        print(f"variant     {variant.arch}: {variant.artifact_name()}.py, decode {render.decode_kernel_hash(variant)}")
        _show_tuned(variant, root, current, indent="  ")
    if current is not None:
        name, capability = current
        runs = config_mod.arch_for_capability(capability)
        print(f"this GPU    {name} ({capability[0]}.{capability[1]}) runs "
              + (f"the {runs} variant" if runs else "none of them (older than every variant)"))
    return 0


def _show_layout(config) -> None:
    from .layout import SPLIT_HIGH_ORDER, SPLIT_LOW_ORDER, Layout

    layout = Layout.from_config(config)
    print(f"slot        {layout.slot_bytes} bytes per token and KV head "
          f"({layout.fp16_bytes_per_token / layout.slot_bytes:.2f}x smaller than fp16 K+V)")
    print(f"  {'field':28s}{'offset':>8s}{'bytes':>7s}")
    for name, offset, size in layout.fields():
        print(f"  {name:28s}{offset:8d}{size:7d}")
    if layout.planes:
        print(f"page        {layout.page_bytes} bytes per page of {layout.page_size} tokens and KV head "
              f"(cache_layout planes: one plane per record)")
        print(f"  {'record':28s}{'plane at':>8s}{'bytes per token':>17s}")
        for name, offset, size in layout.records():
            print(f"  {name:28s}{layout.plane_offset(offset):8d}{size:17d}")
        if layout.has_split_codes:
            print(f"  3-bit codes: the 2-bit low stream, then the 1-bit high stream from record byte "
                  f"{layout.high_bits_offset}")
            print(f"  in each group of 8 codes, 2-bit field i holds code {SPLIT_LOW_ORDER}[i], "
                  f"high bit i code {SPLIT_HIGH_ORDER}[i]")


def _current_gpu():
    """(name, capability) of the current CUDA device, or None without one."""
    if not _cuda_available():
        return None
    import torch

    return torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability())


def _show_tuned(config, root: Path, current, indent: str = "") -> None:
    """The tuned launches a build bakes for one resolved config; `current` is _current_gpu(). `indent`: a
    variant of an arch-auto module (its other archs are shown beside it)."""
    from . import tuned_files

    baked = tuned_files.baked_launches(root, config, lambda message: print(f"{indent}  {message}"))
    current_name = current[0] if current else None
    if not baked and indent:
        print(f"{indent}tuned       none; every shape uses the heuristic launch")
    elif not baked:
        print(f"tuned       none for {config.arch} under {root}; every shape uses the heuristic launch "
              f"(decode_launch_defaults)")
        stem = config.artifact_name().removesuffix(f"_{config.arch}")
        others = sorted(p for p in root.glob(f"*/{stem}_sm*.json") if p.stem != config.artifact_name()) \
            if root.is_dir() else []
        if others:
            print(f"            tuned for other archs (arch: auto carries every arch's; or build with that arch): "
                  f"{', '.join(str(p.relative_to(root)) for p in others)}")
    for device, entry in sorted(baked.items()):
        here = " (this GPU)" if device == current_name else ""
        print(f"{indent}tuned       {device}{here}: {len(entry['buckets'])} buckets, {entry['source']}, "
              f"triton {entry['triton_version']}, {entry['kv_heads']} KV heads (calls bucket their (sequence, KV "
              f"head) pairs)")
        print(f"{indent}  {'bucket':22s}{'block_kv':>9s}{'warps':>6s}{'stages':>7s}{'splits':>7s}")
        for key, launch in entry["buckets"].items():
            print(f"{indent}  {key:22s}" + "".join(f"{value:{width}d}" for value, width in zip(launch, (9, 6, 7, 7))))
    if current_name is not None and current_name not in baked and not indent:
        print(f"tuned       nothing for this GPU ({current_name}): run tqgen tune")


def _cmd_verify(args: argparse.Namespace) -> int:
    if not -2**63 <= args.seed < 2**64:  # what torch's generators take: else a traceback once the module is built
        raise TqgenError(f"verify: --seed {args.seed} is out of range (a 64-bit seed: -2**63 to 2**64-1)")
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    if device == "cuda" and not _cuda_available():
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise TqgenError("verify --device cuda runs the compiled kernels; unset TRITON_INTERPRET, "
                             "or check them in the interpreter with --device cpu")
        raise TqgenError("verify --device cuda needs a CUDA GPU (torch finds none here); "
                         "--device cpu checks the kernels in Triton's interpreter")
    if device == "cpu":
        # Triton reads this when it is first imported, so set it before anything imports it.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            raise TqgenError("--device cpu needs Triton's interpreter; unset TRITON_INTERPRET or set it to 1")
    from . import emit, testing

    failed = 0
    for path in args.configs:
        config = emit.as_config(path)
        module = emit.load(config, args.cache_dir)
        print(f"{path}: {config.artifact_name()} on {device}", flush=True)

        def show(result: testing.CheckResult) -> None:
            print(f"  {'ok  ' if result.passed else 'FAIL'} {result.name:28s}{result.detail}", flush=True)

        results = testing.run_checks(module, config, device=device, seed=args.seed, progress=show)
        failed += sum(not r.passed for r in results)
    if failed:
        print(f"{failed} check(s) failed")
        return EXIT_FAILED
    print("all checks passed")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if not _cuda_available():
        raise TqgenError("bench needs a CUDA GPU (timings under the interpreter mean nothing)")
    import torch

    from . import bench, chart, emit

    if args.chart:
        if "decode" not in args.ops:
            raise TqgenError("bench: --chart draws the decode rows; add decode to --ops")
        chart.require_matplotlib()  # fail before the GPU work, not after it
        make_folder(Path(args.chart).parent)  # likewise: the chart is drawn after every timing
    if args.json:
        make_folder(Path(args.json).parent)  # likewise: a folder that cannot be made loses the whole run
    if args.q_heads < 1 or args.kv_heads < 1 or args.q_heads % args.kv_heads:
        raise TqgenError(f"bench: --q-heads {args.q_heads} must be a positive multiple of --kv-heads {args.kv_heads}")
    # Else a negative tensor size (or a 0-token row) once the decode shapes are timed, and their rows lost.
    _require_positive("bench", {"--store-tokens": args.store_tokens})
    configs = [emit.as_config(path) for path in args.configs]
    if args.batch or args.context:
        if not (args.batch and args.context):
            raise TqgenError("bench: --batch and --context go together")
        _require_positive("bench", {"--batch": args.batch, "--context": args.context})
        shapes = [(b, c) for b in args.batch for c in args.context]
    else:
        shapes = [_parse_shape(text) for text in args.shapes]
    dequant_shapes = [_parse_shape(text) for text in args.dequant_shapes]
    ceiling = bench.copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    rows, op_rows, vllm_rows = [], [], []
    for config in configs:
        module = emit.load(config, args.cache_dir)
        # Each decode op over the decode shapes: (op, what times it, its rows, the end of its progress line).
        decode_ops = (("decode", bench.bench_decode, rows, lambda row: row.launch),
                      ("vllm-decode", bench.bench_vllm_decode, vllm_rows,
                       lambda row: f"{row.module_cost:.2f}x the module's own decode"))
        for op, measure, op_decode_rows, detail in decode_ops:
            if op not in args.ops:
                continue
            for i, (batch, context) in enumerate(shapes, 1):
                row = measure(module, config, batch, context, ceiling_gbps=ceiling, num_q_heads=args.q_heads,
                              num_kv_heads=args.kv_heads)
                op_decode_rows.append(row)
                print(f"[{config.name} {op} {i}/{len(shapes)}] batch {batch} context {context}: "
                      f"{row.graph_us:.1f} us (graph), {row.ceiling_pct:.1f}% of ceiling, "
                      f"{row.speedup_vs_sdpa:.2f}x SDPA, {detail(row)}", flush=True)
        measured = []
        if "store" in args.ops:
            measured += [bench.bench_store(module, config, tokens, ceiling_gbps=ceiling, num_kv_heads=args.kv_heads)
                         for tokens in args.store_tokens]
        if "vllm-store" in args.ops:
            measured += [bench.bench_vllm_store(module, config, tokens, ceiling_gbps=ceiling,
                                                num_kv_heads=args.kv_heads) for tokens in args.store_tokens]
        if "dequantize" in args.ops:
            measured += [bench.bench_dequantize(module, config, batch, context, ceiling_gbps=ceiling,
                                                num_kv_heads=args.kv_heads) for batch, context in dequant_shapes]
        for row in measured:
            print(f"[{config.name} {row.op}] {row.shape}: {row.graph_us:.1f} us, {row.ceiling_pct:.1f}% of ceiling",
                  flush=True)
        op_rows += measured
    print(bench.format_table(rows, ceiling, op_rows, vllm_rows))
    command = shlex.join(["tqgen", *args.argv])
    document = bench.payload(rows, ceiling, bench.run_metadata(args.q_heads, args.kv_heads, command, configs), op_rows,
                             vllm_rows)
    if args.json:
        try:
            bench.write_json(args.json, document)
        except OSError as exc:  # the table above has the rows
            raise TqgenError(f"cannot write the JSON to {args.json}: {write_failure_reason(exc)}") from None
    if args.chart:
        chart.draw(document, args.chart)
        print(f"chart: {args.chart}")
    return 0


def _cmd_chart(args: argparse.Namespace) -> int:
    from . import chart

    print(chart.draw(chart.read_bench_json(args.bench_json), args.png))
    return 0


DEFAULT_BENCH_SHAPES = ("1x4096", "8x8192", "32x8192", "64x16384", "128x4096")


def _require_positive(command: str, options: dict) -> None:
    """Refuse in one line a group of count options (name -> values) where any value is below 1."""
    if any(value < 1 for values in options.values() for value in values):
        names = list(options)
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        got = ", ".join(f"{name} {list(values)}" for name, values in options.items())
        raise TqgenError(f"{command}: {listed} take positive integers, got {got}")


def _parse_shape(text: str) -> tuple[int, int]:
    try:
        batch, context = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise TqgenError(f"bench: shape {text!r} is not BATCHxCONTEXT, e.g. 32x8192") from None
    if batch < 1 or context < 1:
        raise TqgenError(f"bench: shape {text!r} needs a positive batch and context")
    return batch, context


def _cmd_tune(args: argparse.Namespace) -> int:
    if not _cuda_available():
        raise TqgenError("tune needs a CUDA GPU (it times the kernels on the device it tunes for)")
    from . import config as config_mod

    configs = [config_mod.load(path) for path in args.configs]
    from . import emit, tuned_files, tuner
    from .buckets import default_buckets
    from .plan import MAX_NUM_WARPS, MIN_BLOCK_KV, decode_runs_launch

    space = tuner.SearchSpace(**{field: tuple(values) for field, values in (
        ("block_kv", args.block_kv), ("num_warps", args.warps), ("num_stages", args.stages),
        ("num_splits", args.splits)) if values}, rotate_query=_ROTATE_QUERY_WAYS[args.rotate_query],
        merge_max_splits=args.merge_max_splits)
    # Launches decode refuses: every bucket would reject them.
    if not all(decode_runs_launch(v, 1) for v in space.block_kv):
        raise TqgenError(f"tune: --block-kv takes powers of two >= {MIN_BLOCK_KV}, got {list(space.block_kv)}")
    _require_positive("tune", {"--warps": space.num_warps, "--stages": space.num_stages, "--splits": space.num_splits})
    if not all(decode_runs_launch(MIN_BLOCK_KV, v) for v in space.num_warps):
        raise TqgenError(f"tune: --warps takes powers of two up to {MAX_NUM_WARPS}, got {list(space.num_warps)}")
    _require_positive("tune", {"--compile-workers": [args.compile_workers]})
    if args.merge_max_splits is not None:
        _require_positive("tune", {"--merge-max-splits": [args.merge_max_splits]})
    if args.shortlist is not None:
        _require_positive("tune", {"--shortlist": [args.shortlist]})
    if args.shortlist_from is not None and args.shortlist is None:
        raise TqgenError("tune: --shortlist-from ranks the launches of --shortlist K: give K too")
    if args.shortlist_from is not None and not Path(args.shortlist_from).exists():
        raise TqgenError(f"tune: --shortlist-from {args.shortlist_from}: no such file or folder")
    # Else a ZeroDivisionError, a negative tensor size or another bucket's shapes, once the first bucket is drawn.
    _require_positive("tune", {"--kv-heads": [args.kv_heads]})
    _require_positive("tune", {"--group-size": args.group_size})
    _require_positive("tune", {"--batch": args.batch, "--context": args.context})
    buckets = default_buckets(args.group_size, args.batch, args.context)
    root = Path(args.tuned_dir) if args.tuned_dir else emit.default_tuned_dir()
    fingerprint = tuned_files.device_fingerprint()
    errors = []
    for config in (emit.as_config(c) for c in configs):
        started = time.monotonic()
        table = _shortlist_table(args.shortlist_from, config)
        if args.shortlist_from is not None and table is None:
            print(f"{config.name}: no {config.artifact_name()}.json in {args.shortlist_from} to shortlist from",
                  flush=True)
        try:
            module = emit.load(config, args.cache_dir, tuned_dir=root)
            heuristic = " and the heuristic's" if space.heuristic else ""
            print(f"{config.name}: {len(buckets)} buckets x {len(space.candidates())} launches{heuristic} ("
                  f"{len(tuner.bucket_candidates(module, space, 1))} candidates at batch 1, where the query's rotation "
                  f"and the split merge are timed each way asked) on {fingerprint['device_name']}", flush=True)
            path = tuner.tune(config, module, buckets, space, root=root, fingerprint=fingerprint,
                             screen_timer=None if args.exhaustive else tuner.cuda_graph_screen_timer,
                             compile_workers=args.compile_workers, num_kv_heads=args.kv_heads, force=args.force,
                             shortlist_size=args.shortlist, shortlist_from=table,
                             progress=lambda line: print("  " + line, flush=True))
        except TqgenError as exc:  # the next config is independent: tune it, fail at the end
            errors.append(str(exc))
            print(f"{config.name}: error after {time.monotonic() - started:.0f} s: {exc}", flush=True)
            continue
        print(f"{config.name}: wrote {path} in {time.monotonic() - started:.0f} s; "
              f"`tqgen build` bakes it into the module", flush=True)
    if errors:
        raise TqgenError(f"tune: {len(errors)} of {len(configs)} configs did not finish: " + " | ".join(errors))
    return 0


# tqgen tune --rotate-query: the rotations timed where stage 1 can rotate the query (tuner.SearchSpace.rotate_query).
_ROTATE_QUERY_WAYS = {"both": (True, False), "stage1": (True,)}


def _shortlist_table(path: str | None, config) -> Path | None:
    """The tuned file --shortlist-from names for a config of a resolved arch: the file itself, or the config's file
    in that folder (None where it has none: then only the file's own earlier tunes shortlist)."""
    if path is None:
        return None
    if not Path(path).is_dir():
        return Path(path)
    table = Path(path) / f"{config.artifact_name()}.json"
    return table if table.is_file() else None


def _default_compile_workers() -> int:
    return max(1, min(16, (os.cpu_count() or 1) - 1))


def _cuda_available() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import torch

    return torch.cuda.is_available()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other error
        self.exit(EXIT_USAGE, f"tqgen: error: {message} (see tqgen --help)\n")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tqgen", description="Generate TurboQuant KV-cache kernels from YAML configs.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"tqgen {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    build = commands.add_parser("build", help="render configs into importable modules (arch auto: one per arch "
                                "and a dispatcher, whatever GPU this machine has)")
    build.add_argument("configs", nargs="+", metavar="CONFIG", help="YAML config files")
    build.add_argument("-o", "--output", default="build", metavar="DIR", help="output folder (default: build)")
    build.add_argument("--tuned-dir", metavar="DIR",
                       help="tuned launches to bake (default: $TQGEN_TUNED_DIR, else tuned/ of the checkout)")
    build.set_defaults(run=_cmd_build)

    render = commands.add_parser("render", help="print the generated module of one config (arch auto: this "
                                 "machine's arch, sm80 without a GPU)")
    render.add_argument("config", metavar="CONFIG")
    render.set_defaults(run=_cmd_render)

    show = commands.add_parser("show", help="resolved config, slot layout and hashes")
    show.add_argument("config", metavar="CONFIG")
    show.add_argument("--tuned-dir", metavar="DIR", help="default: $TQGEN_TUNED_DIR, else tuned/ of the checkout")
    show.set_defaults(run=_cmd_show)

    verify = commands.add_parser("verify", help="check the generated kernels against the reference")
    verify.add_argument("configs", nargs="+", metavar="CONFIG")
    verify.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if available, else cpu (interpreter)")
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--cache-dir", metavar="DIR", help="where generated modules go (default: $TQGEN_CACHE_DIR, "
                        "else $XDG_CACHE_HOME/tqgen or ~/.cache/tqgen)")
    verify.set_defaults(run=_cmd_verify)

    tune = commands.add_parser("tune", help="pick decode launches per shape bucket on this GPU (writes tuned/)")
    tune.add_argument("configs", nargs="+", metavar="CONFIG")
    tune.add_argument("--group-size", type=int, nargs="+", default=list(DEFAULT_GROUP_SIZES), metavar="G",
                      help="query heads per KV head (default: %(default)s)")
    tune.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES), metavar="B",
                      help="batch sizes, bucketed to powers of two (default: %(default)s)")
    tune.add_argument("--context", type=int, nargs="+", default=list(DEFAULT_CONTEXTS), metavar="T",
                      help="context lengths, bucketed to powers of two (default: %(default)s)")
    tune.add_argument("--block-kv", type=int, nargs="+", metavar="N", help="candidates (default: 32 64)")
    tune.add_argument("--warps", type=int, nargs="+", metavar="N", help="candidates (default: 1 2 4)")
    tune.add_argument("--stages", type=int, nargs="+", metavar="N", help="candidates (default: 1 2)")
    tune.add_argument("--splits", type=int, nargs="+", metavar="N", help="candidates (default: 4 8 16 32 64 128)")
    tune.add_argument("--rotate-query", choices=sorted(_ROTATE_QUERY_WAYS), default="both",
                      help="where configs that can rotate the query in stage 1 have it rotated, up to 8 sequences: "
                           "both ways timed (default), or stage1 alone")
    tune.add_argument("--merge-max-splits", type=int, metavar="N",
                      help="time stage 1 merging its own splits (up to 8 sequences) only for launches of at most N "
                           "splits (default: every launch)")
    tune.add_argument("--shortlist", type=int, metavar="K",
                      help="re-tuning after a kernel change: time in each bucket only the K launches fastest in the "
                           "file's earlier tune (the file, or the one --force kept as NAME.json.replaced-TIME) and "
                           "those it did not time; buckets it lacks time every candidate (default: every candidate; "
                           "docs/tuning.md)")
    tune.add_argument("--shortlist-from", metavar="PATH",
                      help="with --shortlist: buckets the file's own earlier tunes lack take their shortlist from this "
                           "tuned file of another GPU, or from the config's file in this folder (e.g. "
                           "docs/tuning-tables/NVIDIA_H200); the entry names that GPU")
    tune.add_argument("--kv-heads", type=int, default=DEFAULT_KV_HEADS,
                      help="KV heads of the timed problems, query heads = G x this; a module takes a bucket's launch "
                           "for calls of as many (sequence, KV head) pairs, whatever their KV heads (default: "
                           "%(default)s)")
    tune.add_argument("--force", action="store_true",
                      help="re-tune buckets already in the file; a file tuned for another setup (kernel, triton, "
                           "device) or damaged is kept as NAME.json.replaced-TIME and tuned afresh")
    tune.add_argument("--compile-workers", type=int, default=_default_compile_workers(), metavar="N",
                      help="processes that compile the candidates' kernels before the timing; 1: compile each "
                           "when first timed (default: one per CPU core but one, at most 16: %(default)s)")
    tune.add_argument("--exhaustive", action="store_true",
                      help="time every candidate by the full 20 ms run, not only the finalists of a 5 ms screening")
    tune.add_argument("--tuned-dir", metavar="DIR", help="default: $TQGEN_TUNED_DIR, else tuned/ of the checkout")
    tune.add_argument("--cache-dir", metavar="DIR")
    tune.set_defaults(run=_cmd_tune)

    bench = commands.add_parser("bench", help="time decode against the copy ceiling and fp16 SDPA (GPU)")
    bench.add_argument("configs", nargs="+", metavar="CONFIG")
    bench.add_argument("--batch", type=int, nargs="+", metavar="B", help="with --context: every batch x context")
    bench.add_argument("--context", type=int, nargs="+", metavar="T")
    bench.add_argument("--shapes", nargs="+", metavar="BxT", default=list(DEFAULT_BENCH_SHAPES),
                       help="batch x context pairs (default: the BENCHMARKS.md grid's: %(default)s)")
    bench.add_argument("--q-heads", type=int, default=32)
    bench.add_argument("--kv-heads", type=int, default=8)
    bench.add_argument("--ops", nargs="+", choices=("decode", "store", "dequantize", "vllm-decode", "vllm-store"),
                       default=["decode", "store", "dequantize"],
                       help="what to time (default: decode store dequantize); vllm-decode and vllm-store: tqgen.vllm's "
                            "decode (over the decode shapes) and store (over --store-tokens) on vLLM's head-major cache "
                            "in the config's cache layout")
    bench.add_argument("--store-tokens", type=int, nargs="+", metavar="N", default=[32, 4096, 65536],
                       help="tokens per store call (default: %(default)s)")
    bench.add_argument("--dequant-shapes", nargs="+", metavar="BxT", default=["1x4096", "32x8192"],
                       help="batch x context for dequantize (default: %(default)s)")
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    bench.add_argument("--chart", metavar="PNG", help="also draw GB/s against context (needs matplotlib)")
    bench.add_argument("--cache-dir", metavar="DIR")
    bench.set_defaults(run=_cmd_bench)

    chart = commands.add_parser("chart", help="draw a bench JSON file as a PNG (needs matplotlib)")
    chart.add_argument("bench_json", metavar="BENCH_JSON")
    chart.add_argument("png", metavar="PNG")
    chart.set_defaults(run=_cmd_chart)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, as bench's JSON records it
    try:
        return args.run(args)
    except TqgenError as exc:
        print(f"tqgen: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tqgen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
