"""The tuned files: `tuned/<device>/<artifact>.json`, what `tqgen tune` writes and `tqgen build` bakes.

One JSON file per (device, config). Its `metadata` block says what the
timings are valid for; `buckets` maps a shape bucket to the winning launch
parameters and the timing of every candidate::

    {"metadata": {"schema_version": 3, "device_name": "NVIDIA H200", "compute_capability": "9.0",
                  "sm_count": 132, "triton_version": "3.6.0", "torch_version": "2.11.0",
                  "config_hash": "...", "kernel_hash": "...", "template_hash": "...", "tqgen_version": "0.1.0",
                  "date": "..."},
     "buckets": {"g4_b32_t8192": {"group_size": 4, "batch": [17, 32], "context": [4097, 8192],
                                  "best": {"block_kv": 32, "num_warps": 1, "num_stages": 1, "num_splits": 8},
                                  "timings_us": {"kv32_w1_st1_sp8": 652.1, ...}, "rejected": {...}}}}

`kernel_hash` (render.decode_kernel_hash) identifies the decode kernels the
timings were taken on; `template_hash` is recorded for information only, so
edits elsewhere in the templates keep the tuning.

Rules (FlashInfer's): a file whose metadata does not match the running setup,
or that cannot be parsed, is reported with its path and ignored, and never
overwritten. Saving takes a lock, re-reads the file, merges one bucket and
replaces the file atomically, so two tuners never lose each other's buckets
and a killed tuner leaves the buckets it finished.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import glob
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

from . import __version__
from .buckets import BUCKET_KEY_PATTERN, DEFAULT_KV_HEADS, bucket_sort_key
from .config import Config
from .errors import TqgenError
from .files import make_folder, write_atomic, write_failure_reason
from .plan import decode_runs_launch

# 2: matched on kernel_hash instead of template_hash; 3: kernel_hash over the decode path's definitions
# (render.decode_kernel_hash), no longer over the text of a hand-kept list of templates.
SCHEMA_VERSION = 3
# Fields that must equal the running setup for a file's timings to be used.
MATCHED_FIELDS = ("schema_version", "device_name", "compute_capability", "sm_count", "triton_version",
                  "torch_version", "config_hash", "kernel_hash", "tqgen_version")
# What a build (maybe on a machine without that GPU) can check: the kernels are the tuned ones.
SOFTWARE_FIELDS = ("schema_version", "config_hash", "kernel_hash", "tqgen_version")
LAUNCH_FIELDS = ("block_kv", "num_warps", "num_stages", "num_splits")
# A launch's optional fifth field, where stage 1 can rotate the query itself (decode's rotate_query): true
# where it did, false where tq_prepare_query did first. Absent, decode follows its own rule.
ROTATE_FIELD = "rotate_query"
# Its optional sixth, up to the module's _MERGE_IN_STAGE1_MAX_BATCH (decode's merge_in_stage1): true where stage 1
# merged its own splits (one kernel fewer), false where stage 2 did. Absent, stage 2 merges.
MERGE_FIELD = "merge_in_stage1"
LOCK_TIMEOUT_S = 60.0


def device_fingerprint(device_index: int = 0) -> dict[str, Any]:
    """What the running GPU and software stack are (needs CUDA)."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(device_index)
    return {
        "device_name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "triton_version": triton.__version__,
        "torch_version": torch.__version__.split("+")[0],
    }


def make_metadata(config: Config, fingerprint: dict[str, Any]) -> dict[str, Any]:
    from .render import decode_kernel_hash, template_hash

    return {
        "schema_version": SCHEMA_VERSION,
        **{key: fingerprint[key] for key in ("device_name", "compute_capability", "sm_count", "triton_version",
                                             "torch_version")},
        "config_hash": config.hash(),
        "kernel_hash": decode_kernel_hash(config),
        "template_hash": template_hash(),
        "tqgen_version": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def device_folder_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200' (letters, digits, '.', '-', '_')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device_name).strip("_") or "device"


def tuned_path(root: str | os.PathLike, device_name: str, config: Config) -> Path:
    return Path(root) / device_folder_name(device_name) / f"{config.artifact_name()}.json"


def candidate_id(launch: dict[str, int]) -> str:
    """kv64_w1_st2_sp16, with _rq (stage 1 rotates the query) or _pq (tq_prepare_query first) where the
    launch says which, then _ms where stage 1 merges the splits (stage 2 merging them adds nothing)."""
    name = "kv{block_kv}_w{num_warps}_st{num_stages}_sp{num_splits}".format(**launch)
    rotate = launch.get(ROTATE_FIELD)
    name = name if rotate is None else name + ("_rq" if rotate else "_pq")
    return name + "_ms" if launch.get(MERGE_FIELD) else name


_CANDIDATE_ID = re.compile(r"kv(\d+)_w(\d+)_st(\d+)_sp(\d+)(_rq|_pq)?(_ms)?")


def launch_of_id(name: str) -> dict | None:
    """The launch a candidate id names (candidate_id's inverse: a merge by stage 2 has no suffix, so it reads back
    without a MERGE_FIELD); None for a string that is no candidate id."""
    match = _CANDIDATE_ID.fullmatch(name)
    if not match:
        return None
    launch = dict(zip(LAUNCH_FIELDS, (int(group) for group in match.groups()[:4])))
    if match.group(5):
        launch[ROTATE_FIELD] = match.group(5) == "_rq"
    if match.group(6):
        launch[MERGE_FIELD] = True
    return launch


def baked_launch(best: dict) -> tuple:
    """A bucket's best launch as a module bakes it: the LAUNCH_FIELDS, then the ROTATE_FIELD if it has one; with
    a MERGE_FIELD, the ROTATE_FIELD or None and then the MERGE_FIELD."""
    launch = tuple(best[f] for f in LAUNCH_FIELDS)
    if MERGE_FIELD in best:
        return launch + (best.get(ROTATE_FIELD), best[MERGE_FIELD])
    return launch + ((best[ROTATE_FIELD],) if ROTATE_FIELD in best else ())


class Unusable(Exception):
    """A tuned file that exists but must be ignored (the message says why, with the path)."""


def read(path: Path, expected: dict[str, Any], fields: tuple[str, ...] = MATCHED_FIELDS) -> dict[str, Any]:
    """The buckets of a tuned file that matches `expected` metadata; {} if there is no file.

    Raises `Unusable` for a file that is corrupt, truncated, of another shape,
    or tuned for another setup (naming the fields that differ).
    """
    document = _read_document(path, expected, fields)
    return document["buckets"] if document else {}


def _read_document(path: Path, expected: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any] | None:
    """The whole checked document (metadata and buckets), or None if there is no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise Unusable(f"{path}: cannot be read ({exc})") from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise Unusable(f"{path}: corrupt or truncated JSON ({exc})") from None
    if not (isinstance(document, dict) and isinstance(document.get("metadata"), dict)
            and isinstance(document.get("buckets"), dict)):
        raise Unusable(f"{path}: not a tuned file (expected 'metadata' and 'buckets' mappings)")
    metadata = document["metadata"]
    differing = [f"{field} {metadata.get(field)!r} != {expected.get(field)!r}" for field in fields
                 if metadata.get(field) != expected.get(field)]
    if differing:
        raise Unusable(f"{path}: tuned for another setup ({'; '.join(differing)})")
    # A build bakes these two beside the buckets (baked_launches), and render sorts the keys as bucket keys.
    for field in ("device_name", "triton_version"):
        if not isinstance(metadata.get(field), str):
            raise Unusable(f"{path}: metadata {field} is {metadata.get(field)!r}, expected a string")
    for key, entry in document["buckets"].items():
        if not BUCKET_KEY_PATTERN.fullmatch(key):
            raise Unusable(f"{path}: bucket {key!r} is not a bucket key like 'g4_b32_t8192'")
        best = entry.get("best") if isinstance(entry, dict) else None
        # type(...) is int: a JSON true is an int to isinstance, and no launch field takes it.
        if not (isinstance(best, dict) and all(type(best.get(f)) is int and best[f] > 0 for f in LAUNCH_FIELDS)
                and isinstance(best.get(ROTATE_FIELD, False), bool) and isinstance(best.get(MERGE_FIELD, False), bool)
                and decode_runs_launch(best["block_kv"], best["num_warps"])):  # else every call of it would fail
            raise Unusable(f"{path}: bucket {key!r} has no valid 'best' launch")
    counts = sorted({timed_kv_heads(entry) for entry in document["buckets"].values()})
    if len(counts) > 1:  # a module counts a call's batch in (sequence, KV head) pairs over one count
        raise Unusable(f"{path}: its buckets were timed over different KV head counts ({counts})")
    return document


def timed_kv_heads(entry: dict) -> int:
    """The KV heads a bucket's launches were timed over (`tqgen tune --kv-heads`, in its `shape`)."""
    shape = entry.get("shape")
    count = shape.get("num_kv_heads", DEFAULT_KV_HEADS) if isinstance(shape, dict) else DEFAULT_KV_HEADS
    return count if type(count) is int and count > 0 else DEFAULT_KV_HEADS


def buckets_kv_heads(buckets: dict) -> int | None:
    """The KV heads a file's buckets were timed over (read() refuses a file that mixes counts), None for none."""
    return next((timed_kv_heads(entry) for entry in buckets.values()), None)


def _try_flock(handle) -> bool:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _lock_name(lock_path: Path, timeout_s: float):
    """An open handle holding an exclusive flock on the file `lock_path` names when the lock is taken. A holder
    deletes the name when done (locked), so a lock won on a file the name no longer refers to is dropped and
    taken again on the current one."""
    deadline = time.monotonic() + timeout_s
    while True:
        handle = open(lock_path, "a+")
        while not _try_flock(handle):
            if time.monotonic() > deadline:
                handle.close()
                raise TqgenError(f"{lock_path}: still locked by another tuner after {timeout_s:.0f} s")
            time.sleep(0.05)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        handle.close()


@contextlib.contextmanager
def locked(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive advisory lock on `<path>.lock` (released when the process dies).

    The holder deletes the lock file when it is done, so a tune leaves nothing beside the tuned files (a wheel
    packs all of tuned/); a waiter that locked the deleted file locks the name's new one (_lock_name)."""
    lock_path = path.with_name(path.name + ".lock")
    make_folder(path.parent)  # or one line saying why it cannot be
    try:  # a folder that takes no files: one line too, not a traceback
        handle = _lock_name(lock_path, timeout_s)
    except OSError as exc:
        raise TqgenError(f"the folder {path.parent} cannot be written: {lock_path.name} cannot be created "
                         f"({write_failure_reason(exc)})") from None
    with handle:  # closing the handle releases the lock
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)  # while still locked: no one else holds this name's file


def check_writable(path: Path) -> None:
    """Create the tuned file's folder and take and drop its lock, or say in one line why that cannot be (TqgenError):
    before a tune times anything it could not save."""
    with locked(path):
        pass


def set_aside_unusable(path: Path, expected: dict[str, Any]) -> tuple[Path | None, dict[str, Any]]:
    """Under the file's lock, check it again: if it is still unusable, rename it to
    NAME.json.replaced-TIME beside it (a name no reader looks for) and return (new path, {});
    if another tuner has replaced it meanwhile, return (None, its buckets). Nothing is deleted."""
    with locked(path):
        try:
            return None, read(path, expected)
        except Unusable:
            pass
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        kept = path.with_name(f"{path.name}.replaced-{stamp}")
        number = 1
        while kept.exists():
            number += 1
            kept = path.with_name(f"{path.name}.replaced-{stamp}-{number}")
        os.replace(path, kept)
    return kept, {}


def set_aside_files(path: Path) -> list[Path]:
    """The files set_aside_unusable kept in place of the file at `path` (NAME.json.replaced-TIME), oldest first."""
    return sorted(path.parent.glob(f"{glob.escape(path.name)}.replaced-*"))


def _timed_buckets(source: Path) -> tuple[dict[str, Any], dict[str, tuple[dict[str, Any], str]]]:
    """(metadata, bucket key -> (entry, the kernel_hash it was timed on)) of one tuned file, the buckets that timed
    some launch, every timing a number; raises ValueError (or OSError) for a file that cannot be read as one."""
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
        metadata, buckets = document["metadata"], dict(document["buckets"])
        str(metadata["device_name"])
    except (UnicodeDecodeError, LookupError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a tuned file ({type(exc).__name__})") from None
    found = {}
    for key, entry in buckets.items():
        timings = entry.get("timings_us") if isinstance(entry, dict) else None
        if isinstance(timings, dict) and timings and all(type(us) in (int, float) for us in timings.values()):
            found[key] = (entry, str(metadata.get("kernel_hash")))
    return metadata, found


def earlier_buckets(path: Path, device_name: str) -> dict[str, tuple[dict[str, Any], str]]:
    """Each bucket's timings from earlier tunes of this file, whatever kernel they were timed on: the file at `path`
    and the ones a `--force` re-tune kept beside it (NAME.json.replaced-TIME), the file itself first, then the most
    recently kept. Maps a bucket key to (its entry, the kernel_hash it was timed on); a file of another device, or
    one that cannot be read, adds nothing. What `tqgen tune --shortlist` ranks the candidates by."""
    found: dict[str, tuple[dict[str, Any], str]] = {}
    for source in set_aside_files(path) + [path]:  # oldest first: a later file's entry replaces an earlier one's
        try:
            metadata, timed = _timed_buckets(source)
        except (OSError, ValueError):
            continue
        if metadata["device_name"] == device_name:
            found.update(timed)
    return found


def table_buckets(source: Path, config: Config) -> tuple[str, dict[str, tuple[dict[str, Any], str]]]:
    """Another tune's file of this config, of any GPU (`tqgen tune --shortlist-from`): (its device name, bucket key
    -> (entry, kernel_hash)) as earlier_buckets gives them. Refuses (TqgenError, one line) a file that cannot be read
    or was tuned for another config."""
    try:
        metadata, found = _timed_buckets(source)
    except (OSError, ValueError) as exc:
        reason = write_failure_reason(exc) if isinstance(exc, OSError) else str(exc)
        raise TqgenError(f"--shortlist-from {source}: cannot be read ({reason})") from None
    if metadata.get("config_hash") != config.hash():
        raise TqgenError(f"--shortlist-from {source}: tuned for another config (config_hash "
                         f"{str(metadata.get('config_hash'))[:12]}, {config.name}'s is {config.hash()[:12]})")
    return str(metadata["device_name"]), found


def save_bucket(path: Path, metadata: dict[str, Any], key: str, entry: dict[str, Any]) -> None:
    """Merge one bucket into the file under the lock and replace the file atomically.

    Refuses (TqgenError) to touch a file that is corrupt or tuned for another
    setup: that file is someone's data.
    """
    with locked(path):
        try:
            buckets = read(path, metadata)
        except Unusable as exc:
            raise TqgenError(f"not overwriting {exc}; move it away to re-tune") from None
        timed = buckets_kv_heads(buckets)
        if timed is not None and timed_kv_heads(entry) != timed:
            raise TqgenError(f"not adding bucket {key} timed over {timed_kv_heads(entry)} KV heads to {path}, whose "
                             f"buckets were timed over {timed}; move it away to re-tune")
        buckets = {**buckets, key: entry}
        ordered = dict(sorted(buckets.items(), key=lambda item: bucket_sort_key(item[0])))
        document = {"metadata": metadata, "buckets": ordered}
        try:
            write_atomic(path, (json.dumps(document, indent=1) + "\n").encode("utf-8"))
        except OSError as exc:  # a full disk: the file keeps its earlier buckets (write_atomic)
            raise TqgenError(f"{path} cannot be written ({write_failure_reason(exc)}); it keeps its earlier "
                             f"buckets") from None


def baked_launches(root: Path, config: Config, warn) -> dict[str, dict]:
    """Every device's tuned launches for this config under `root`, as render() bakes them.

    Files for other kernels (config, decode kernel source, tqgen version) or that
    are corrupt are reported through `warn` and skipped. Of several files for one
    device (a copy of its folder kept beside it), the one in the folder the tuner
    writes (tuned_path) is baked, else the first by folder name; the others are
    reported.
    """
    from .render import decode_kernel_hash

    baked: dict[str, dict] = {}
    found: dict[str, Path] = {}  # device name -> the file baked for it
    paths = sorted(p for p in root.glob(f"*/{config.artifact_name()}.json") if p.is_file()) if root.is_dir() else []
    if not paths:
        return baked  # no render of the decode kernels just to hash them
    expected = {"schema_version": SCHEMA_VERSION, "config_hash": config.hash(),
                "kernel_hash": decode_kernel_hash(config), "tqgen_version": __version__}
    for path in paths:
        device_dir = path.parent
        try:
            document = _read_document(path, expected, SOFTWARE_FIELDS)
        except Unusable as exc:
            warn(f"tqgen: ignoring {exc}")
            continue
        if not document or not document["buckets"]:
            continue
        metadata, buckets = document["metadata"], document["buckets"]
        device = metadata["device_name"]
        earlier = found.get(device)
        if earlier is not None:
            # The tuner's own folder wins; else the first by name, as paths are sorted.
            kept, left = (path, earlier) if device_dir.name == device_folder_name(device) else (earlier, path)
            warn(f"tqgen: ignoring {left.relative_to(root)} ({device}): {kept.relative_to(root)} is baked for that "
                 f"device (tqgen tune writes {device_folder_name(device)}/)")
            if kept is earlier:
                continue
        found[device] = path
        baked[device] = {
            "triton_version": metadata["triton_version"],
            "source": f"{device_dir.name}/{path.name} ({str(metadata.get('date', ''))[:10]})",
            # A module buckets a call's batch in (sequence, KV head) pairs over this many (buckets.bucket_batch).
            "kv_heads": buckets_kv_heads(buckets),
            "buckets": {key: baked_launch(entry["best"]) for key, entry in buckets.items()},
        }
    return baked
