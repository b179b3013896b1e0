"""What `tqgen tune --shortlist K` would have lost in the re-tunes of the committed tuned files' git history.

    python3 tools/shortlist_regret.py [--sizes 4 8 12 16] [FILE ...]

For each tuned file (default: every file under tuned/) it walks the file's commits and takes each pair of
successive tunes (a later commit whose bucket re-timed the candidates, not a migration or an added bucket). For
each bucket both timed, the later tune's candidates are shortlisted by the earlier tune's timings (tuner.shortlist:
the K fastest there, plus those it never timed), and the bucket's regret is the later tune's best time among the
shortlist over its best of all. Prints per K: buckets, how many the shortlist missed the best of, by more than 2%,
the worst regret and the mean, and how many of the candidates the shortlists timed. The later tune's timings of
candidates it did not retime are its 5 ms screenings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tqgen import tuned_files, tuner  # noqa: E402

def launch_of(name: str) -> dict:
    """The launch a candidate id names (tuned_files.launch_of_id), or ValueError."""
    launch = tuned_files.launch_of_id(name)
    if launch is None:
        raise ValueError(f"not a candidate id: {name!r}")
    return launch


def tunes(path: Path) -> list[dict]:
    """The file's distinct versions in its git history, oldest first (each a document's buckets)."""
    relative = path.resolve().relative_to(REPO)
    commits = subprocess.run(["git", "log", "--format=%H", "--", str(relative)], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout.split()
    versions = []
    for commit in reversed(commits):
        shown = subprocess.run(["git", "show", f"{commit}:{relative}"], cwd=REPO, capture_output=True, text=True)
        try:
            buckets = json.loads(shown.stdout)["buckets"]
        except (ValueError, LookupError, TypeError):
            continue  # deleted or damaged in that commit
        if not versions or buckets != versions[-1]:
            versions.append(buckets)
    return versions


def regrets(earlier: dict, later: dict, size: int) -> list[tuple[float, int, int]]:
    """Per bucket re-timed by the later tune: its best among the shortlist over its best, the shortlist's length
    and the candidates it was drawn from."""
    found = []
    for key, entry in later.items():
        before = earlier.get(key)
        if not isinstance(before, dict) or before.get("timings_us") == entry["timings_us"]:
            continue  # a bucket new in the later tune, or carried over unchanged
        timings = entry["timings_us"]
        launches = [launch_of(name) for name in [*timings, *entry.get("rejected", {})]]
        picked = [tuned_files.candidate_id(launch) for launch in tuner.shortlist(launches, before, size)]
        found.append((min(timings.get(name, float("inf")) for name in picked) / min(timings.values()), len(picked),
                      len(launches)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="default: every tuned file under tuned/")
    parser.add_argument("--sizes", nargs="+", type=int, default=[4, 8, 12, 16], metavar="K")
    args = parser.parse_args()
    files = args.files or sorted((REPO / "tuned").glob("*/*.json"))
    pairs = []
    for path in files:
        versions = tunes(path)
        pairs += zip(versions, versions[1:])
    print(f"{len(files)} files, {len(pairs)} successive tunes")
    for size in args.sizes:
        rows = [row for earlier, later in pairs for row in regrets(earlier, later, size)]
        if not rows:
            print(f"K {size}: no bucket was re-timed")
            continue
        found = [regret for regret, _, _ in rows]
        timed, of = sum(row[1] for row in rows), sum(row[2] for row in rows)
        print(f"K {size:3d}: {len(found)} buckets, best missed in {sum(r > 1 for r in found)}, by > 2% in "
              f"{sum(r > 1.02 for r in found)}; worst {max(found):.3f}x, mean {sum(found) / len(found):.4f}x; "
              f"{timed} of {of} candidates timed ({timed / of:.0%})")


if __name__ == "__main__":
    main()
