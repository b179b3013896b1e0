"""Carry committed tuned files across a change that leaves the decode kernels' PTX identical.

    python3 tools/migrate_tuned.py --from-commit REV [--configs configs/*.yaml] [--tuned-dir tuned] [--dry-run]

A tuned file is valid for the decode code it was timed on (its `kernel_hash`). A refactor of
the templates, or of how that hash is computed, changes the hash without changing what the
GPU runs. Rather than silently keep (or drop) such tuning, this tool proves the kernels are
the same and records it in each file:

1. checks out REV (the commit the files were tuned on) into a temporary worktree and checks,
   for each config, that REV's `decode_kernel_hash` is the file's `kernel_hash`;
2. compiles every decode kernel (stage 1 on tl.dot and on mma.sync, stage 2, tq_prepare_query)
   of the config offline for sm90, at REV and here, over every tile / warps / stages the
   tuned files time and both constexpr switches (tools/kernel_fingerprint.py), and compares
   their PTX without source locations;
3. only if every decode kernel is identical, rewrites the file's metadata to this tree's
   schema, kernel hash and template hash, with `migrated` saying from which hash and commit,
   why, and on what evidence (and which decode kernels this tree adds: they were never timed, so
   no tuned bucket picks them until a re-tune). Timings and buckets are untouched; anything else
   is refused. A file whose config's decode hash the change left as it was is left as it is.

Runs on the CPU; takes a few minutes per config (offline compiles).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DECODE_KERNELS = ("stage1_", "stage2_", "prepare_query")
_HASH_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tqgen import config as config_mod, render
out = {}
for path in sys.argv[2:]:
    config = config_mod.resolve_arch(config_mod.load(path), (9, 0))
    out[path] = [config.artifact_name(), render.decode_kernel_hash(config)]
print(json.dumps(out))
"""


def _fingerprints(checkout: Path, configs: list[str], out: Path) -> subprocess.Popen:
    tool = checkout / "tools" / "kernel_fingerprint.py"
    if not tool.exists():  # an older commit without the tool: run this tree's copy against it
        tool.parent.mkdir(exist_ok=True)
        tool.write_bytes((ROOT / "tools" / "kernel_fingerprint.py").read_bytes())
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.Popen([sys.executable, str(tool), str(out), "--only", *DECODE_KERNELS,
                             "--configs", *[str(ROOT / c) for c in configs]],
                            cwd=checkout, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-commit", required=True, help="the commit the tuned files were tuned on")
    parser.add_argument("--configs", nargs="+", default=sorted(glob.glob("configs/*.yaml")))
    parser.add_argument("--tuned-dir", default="tuned")
    parser.add_argument("--dry-run", action="store_true", help="check and report, write nothing")
    parser.add_argument("--old-fingerprint", metavar="JSON",
                        help="REV's decode kernels as tools/kernel_fingerprint.py --only stage1_ stage2_ prepare_query "
                             "wrote them at REV (skips compiling REV again)")
    args = parser.parse_args()

    import triton  # the fingerprints are compiled by this interpreter's triton (sys.executable)

    from tqgen import __version__, config as config_mod, render, tuned_files
    from tqgen.files import write_atomic

    with tempfile.TemporaryDirectory(prefix="tqgen-migrate-") as folder:
        old_tree = Path(folder) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree), args.from_commit],
                       check=True, capture_output=True)
        try:
            old_hashes = json.loads(subprocess.run(
                [sys.executable, "-c", _HASH_SCRIPT, str(old_tree), *[str(ROOT / c) for c in args.configs]],
                check=True, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}).stdout)
            print(f"compiling the decode kernels of {len(args.configs)} configs at {args.from_commit} and here",
                  flush=True)
            trees = (("new", ROOT),) if args.old_fingerprint else (("old", old_tree), ("new", ROOT))
            runs = [_fingerprints(tree, args.configs, Path(folder) / f"{name}.json") for name, tree in trees]
            if any(run.wait() for run in runs):
                raise SystemExit("an offline compile failed; run tools/kernel_fingerprint.py by hand to see why")
            old_file = Path(args.old_fingerprint) if args.old_fingerprint else Path(folder) / "old.json"
            old_ptx, new_ptx = (json.loads(path.read_text()) for path in (old_file, Path(folder) / "new.json"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)],
                           capture_output=True)

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.from_commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    refused = 0
    for path in args.configs:
        config = config_mod.resolve_arch(config_mod.load(path), (9, 0))
        artifact, old_hash = old_hashes[str(ROOT / path)]
        key = f"{os.path.basename(path)}:sm90"
        old, new = old_ptx[key], new_ptx[key]
        decode = sorted(label for label in old if label.startswith(DECODE_KERNELS))
        differing = [label for label in decode if old[label] != new.get(label) or old[label].startswith("error")]
        added = sorted(label for label in new if label.startswith(DECODE_KERNELS) and label not in old)
        for tuned_path in sorted(Path(args.tuned_dir).glob(f"*/{artifact}.json")):
            document = json.loads(tuned_path.read_text())
            metadata = document["metadata"]
            if metadata.get("kernel_hash") != old_hash:
                print(f"{tuned_path}: refused: tuned for kernel_hash {metadata.get('kernel_hash', '')[:12]}, "
                      f"not {args.from_commit}'s {old_hash[:12]}")
                refused += 1
                continue
            new_hash = render.decode_kernel_hash(config)
            if new_hash == old_hash:  # the change left this config's decode path as it was: nothing to carry
                print(f"{tuned_path}: current (kernel_hash {old_hash[:12]} unchanged), left as it is")
                continue
            if differing or not decode:
                print(f"{tuned_path}: refused: decode kernels differ from {args.from_commit}: {differing}")
                refused += 1
                continue
            metadata.update(
                schema_version=tuned_files.SCHEMA_VERSION, kernel_hash=new_hash, template_hash=render.template_hash(),
                tqgen_version=__version__,
                migrated={"from_kernel_hash": old_hash, "from_commit": commit,
                          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "evidence": f"PTX of all {len(decode)} decode kernel specializations identical "
                                      f"(tools/kernel_fingerprint.py, sm90, triton {triton.__version__})",
                          **({"untimed_new_kernels": added} if added else {})})
            print(f"{tuned_path}: {len(decode)} decode kernels identical; kernel_hash {old_hash[:12]} -> "
                  f"{new_hash[:12]}" + (" (dry run)" if args.dry_run else ""))
            if not args.dry_run:
                write_atomic(tuned_path, (json.dumps(document, indent=1) + "\n").encode("utf-8"))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
