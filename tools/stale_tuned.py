"""The configs whose committed tuned files for one GPU no longer match their decode kernels: what a re-tune must redo.

    python3 tools/stale_tuned.py [--device "NVIDIA H200"] [--capability 9.0] [--tuned-dir tuned]
                                 [--stale-only | --include-current] [CONFIG ...]

A tuned file holds the launches timed on one version of the decode code (its `kernel_hash`); after a change to
the decode kernels a build ignores it and `test_committed_tuned_files_are_current` fails, until the config is
re-tuned on that GPU. Prints one line per such config (default: every shipped config; the arch is the device's,
from --capability, which the H100 and H200 need not be given): the config's path and the query heads per KV head
its file was tuned for, as `tqgen tune --group-size` takes them, so that the re-tune covers what the file covered
(the planes files have 1, 4, 8 and 16; the slots files 4). Prints nothing when every file is current or absent
(a GPU without a tuned folder: a note on stderr). A file too damaged to say its group sizes is named on stderr
after the list, and the exit status is 1. tools/run_gpu.sh's tune step re-tunes these for the GPU it runs on
unless TQGEN_TUNE_CONFIGS names configs.

A re-tune cut off part way (tools/run_gpu.sh returns what it saved) leaves a current file beside the stale one that
`tqgen tune --force` set aside (NAME.json.replaced-TIME): while that one holds buckets the current file lacks, the
config is listed too, with both files' group sizes, so the next run resumes it (`tqgen tune` without --force keeps
the current file's buckets and tunes the rest, shortlisted by the set-aside file's timings). --stale-only leaves
those out: the files that need --force. --include-current lists every config, stale or not, and one without a
file alone on its line: what run_gpu.sh tunes for the configs named.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tqgen import config as config_mod  # noqa: E402
from tqgen import tuned_files  # noqa: E402
from tqgen.errors import TqgenError  # noqa: E402

# Compute capability of the devices tqgen ships tuned files for, by name (the arch their kernels are built for).
DEVICE_CAPABILITY = {"NVIDIA H200": (9, 0), "NVIDIA H100 80GB HBM3": (9, 0)}


def stale_configs(paths, device: str, capability: tuple[int, int], tuned_dir: Path, problems: list[str],
                  include_current: bool = False, stale_only: bool = False) -> list[tuple[Path, list[int]]]:
    """(config path, group sizes of its file) for each config whose file for `device` a build would ignore, or
    whose re-tune was cut off part way (unless stale_only); a line in `problems` for each such file too damaged to
    say its group sizes (the configs after it are still listed). include_current: every config, a current file's
    too, and one with no file with no group sizes."""
    listed = []
    for path in paths:
        try:
            config = config_mod.resolve_arch(config_mod.load(path if Path(path).exists() else REPO / path), capability)
        except TqgenError as exc:
            sys.exit(f"stale_tuned: {exc}")
        tuned = tuned_files.tuned_path(tuned_dir, device, config)
        if not tuned.is_file():
            if include_current:
                listed.append((Path(path), []))
            continue
        current = device in tuned_files.baked_launches(tuned_dir, config, lambda message: None)
        if current and stale_only:
            continue
        try:
            buckets = _buckets(tuned)
            if current:
                resumed = cut_off_retune(tuned, buckets)
                if not resumed and not include_current:
                    continue
                buckets = {**resumed, **buckets}  # a cut-off re-tune's group sizes are the set-aside file's too
            groups = sorted({entry["group_size"] for entry in buckets.values()})
            if not all(type(group) is int and group > 0 for group in groups):
                raise ValueError(f"group sizes {groups}")
        except (OSError, ValueError, LookupError, TypeError, AttributeError) as exc:
            problems.append(f"{tuned}: damaged, its group sizes unknown ({type(exc).__name__}: {exc}); re-tune "
                            f"{path} with `tqgen tune --force --group-size ...`")
            continue
        listed.append((Path(path), groups or [4]))
    return listed


def cut_off_retune(tuned: Path, buckets: dict) -> dict:
    """The buckets of the stale file a re-tune set aside beside the current file `tuned` (whose buckets are
    `buckets`), if it holds some the current file lacks: that re-tune was cut off. Else, or if it is damaged, {}."""
    set_aside = tuned_files.set_aside_files(tuned)
    try:
        earlier = _buckets(set_aside[-1]) if set_aside else {}
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return {}
    return earlier if set(earlier) - set(buckets) else {}


def _buckets(path: Path) -> dict:
    return dict(json.loads(path.read_text(encoding="utf-8"))["buckets"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="default: every config in configs/")
    parser.add_argument("--device", default="NVIDIA H200", help="the GPU's name, as torch reports it")
    parser.add_argument("--capability", metavar="MAJOR.MINOR",
                        help="the GPU's compute capability, which names its files' arch (default: known for "
                             + ", ".join(DEVICE_CAPABILITY) + ")")
    parser.add_argument("--tuned-dir", type=Path, default=REPO / "tuned")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--stale-only", action="store_true",
                       help="leave out re-tunes cut off part way: only the files that need `tqgen tune --force`")
    which.add_argument("--include-current", action="store_true",
                       help="list current files' configs too, and configs with no file (without group sizes)")
    args = parser.parse_args()
    if not args.tuned_dir.is_dir():
        sys.exit(f"--tuned-dir {args.tuned_dir}: no such folder")
    capability = DEVICE_CAPABILITY.get(args.device)
    if args.capability is not None:
        major, _, minor = args.capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            sys.exit(f"stale_tuned: --capability {args.capability!r}: expected MAJOR.MINOR, like 9.0")
        capability = (int(major), int(minor))
    folder = args.tuned_dir / tuned_files.device_folder_name(args.device)
    if not folder.is_dir() and not args.include_current:
        print(f"stale_tuned: no tuned files for {args.device} (no folder {folder}): nothing to re-tune",
              file=sys.stderr)
        return
    if capability is None:  # its files are named for its arch: guessed wrong, every one would look absent
        sys.exit(f"stale_tuned: the compute capability of {args.device} is not known here: pass --capability "
                 f"MAJOR.MINOR")
    # The shipped configs by their full path: a configs/ in the working directory (another checkout's) is not
    # this repository's; printed relative to the repository, where tools/run_gpu.sh runs.
    paths = args.configs or sorted((REPO / "configs").glob("*.yaml"))
    problems = []
    for path, groups in stale_configs(paths, args.device, capability, args.tuned_dir, problems, args.include_current,
                                      args.stale_only):
        print(path if args.configs else path.relative_to(REPO), *groups)
    for problem in problems:
        print(problem, file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
