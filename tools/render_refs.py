"""Render one config's module from several git refs, for tools/ab_modules.py on the GPU machine.

    python3 tools/render_refs.py CONFIG REF [REF ...] [--arch sm90] [--out out/ab]

The GPU machine runs a copy of the working tree, not the repository's other branches: render the modules of an
experiment branch and of main here (each ref checked out in a temporary git worktree, rendered by its own tqgen
and templates, for the GPU's arch), carry the output folder, and time them side by side there:

    python3 tools/render_refs.py configs/k3v4-d128-planes.yaml main experiment/prefetch-blocks
    # device: python3 tools/ab_modules.py configs/k3v4-d128-planes.yaml out/ab/main-k3v4-d128-planes.py \\
    #             out/ab/experiment-prefetch-blocks-k3v4-d128-planes.py --shapes 1x4096 8x8192

Each module is written as REF-CONFIG.py (a ref's slashes as dashes); its path is printed. A ref that does not
exist, or whose tqgen cannot render the config, stops with that ref named and its error.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def render_at(ref: str, config: Path, arch: str, out_dir: Path) -> Path:
    """The module of `config` (a path inside the repository) as `ref` renders it for `arch`."""
    target = out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '-', ref)}-{config.stem}.py"
    with tempfile.TemporaryDirectory(prefix="tqgen-ref-") as folder:
        tree = Path(folder) / "tree"
        added = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), ref],
                               capture_output=True, text=True)
        if added.returncode:
            sys.exit(f"{ref}: {added.stderr.strip() or 'git worktree add failed'}")
        try:
            source = (tree / config).read_text()
            pinned = re.sub(r"(?m)^arch:.*$", "", source).rstrip("\n") + f"\narch: {arch}\n"
            pinned_path = Path(folder) / config.name
            pinned_path.write_text(pinned)
            rendered = subprocess.run([sys.executable, "-m", "tqgen.cli", "render", str(pinned_path)], cwd=tree,
                                      env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
            if rendered.returncode:
                sys.exit(f"{ref}: tqgen render {config} failed: {rendered.stderr.strip().splitlines()[-1:]}")
            target.write_text(rendered.stdout)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("refs", nargs="+")
    parser.add_argument("--arch", default="sm90", help="the GPU's arch (default: sm90, the H200)")
    parser.add_argument("--out", default="out/ab", help="output folder (default: out/ab, ignored by git)")
    args = parser.parse_args()
    config = Path(args.config).resolve().relative_to(REPO)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for ref in args.refs:
        print(render_at(ref, config, args.arch, out_dir))


if __name__ == "__main__":
    main()
