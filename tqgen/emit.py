"""Emit rendered modules as files, and import them.

`build` writes `<out_dir>/<artifact_name>.py` atomically (temp file in the same
folder, fsync, rename), and only when its bytes change, so a killed build
leaves the old module or the new one, never a partial file. For `arch: auto` it
writes, whatever machine it runs on, one module per known arch plus the
dispatcher that picks one per device (tqgen/dispatch.py): all temp files first,
then the renames, the dispatcher last (files.write_atomic_group). `load` builds
into a cache folder when needed and imports the module; it resolves `arch: auto`
to the machine it runs on, the machine that then runs the module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Union

from . import config as config_mod
from . import dispatch
from .config import Config
from .errors import TqgenError
from .files import GroupWriteError, make_folder, write_atomic_group, write_failure_reason
from .render import render

ConfigLike = Union[Config, str, os.PathLike]


def default_cache_dir() -> Path:
    """$TQGEN_CACHE_DIR, else $XDG_CACHE_HOME/tqgen, else ~/.cache/tqgen."""
    if os.environ.get("TQGEN_CACHE_DIR"):
        return Path(os.environ["TQGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tqgen"


def default_tuned_dir() -> Path:
    """$TQGEN_TUNED_DIR, else tuned/ of the checkout, else the copy packaged into the wheel."""
    if os.environ.get("TQGEN_TUNED_DIR"):
        return Path(os.environ["TQGEN_TUNED_DIR"])
    package = Path(__file__).resolve().parent
    checkout = package.parent / "tuned"
    return checkout if checkout.is_dir() else package / "_tuned"


def tuned_dir_to_read(tuned_dir: str | os.PathLike | None = None) -> Path:
    """The folder of tuned files a build or `tqgen show` reads: tuned_dir, else default_tuned_dir(). A folder named
    by the user (tuned_dir, $TQGEN_TUNED_DIR) that is not one is refused in one line (TqgenError): read as it is,
    it holds no tuned files, and every module would be built with the heuristic launches as if never tuned.
    (A tune may name a folder that does not exist yet: it makes it.)"""
    if tuned_dir is not None:
        root, named = Path(tuned_dir), "--tuned-dir"
    elif os.environ.get("TQGEN_TUNED_DIR"):
        root, named = default_tuned_dir(), "$TQGEN_TUNED_DIR"
    else:
        return default_tuned_dir()
    if not root.is_dir():
        why = "is a file, not a folder" if root.exists() else "no such folder"
        raise TqgenError(f"{named} {root}: {why} (the tuned files to bake; tqgen tune writes them)")
    return root


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def as_config(config_or_path: ConfigLike) -> Config:
    """A Config from a Config or a YAML path, with the arch resolved."""
    config = config_or_path if isinstance(config_or_path, Config) else config_mod.load(config_or_path)
    return config_mod.resolve_arch(config)


@dataclasses.dataclass(frozen=True)
class BuiltVariant:
    """One arch's module of an arch-auto build."""
    arch: str
    path: Path
    tuned: dict  # device name -> baked launches (tuned_files.baked_launches)


@dataclasses.dataclass(frozen=True)
class Built:
    """What a build wrote: the module to import (for arch auto, the dispatcher) and what it carries."""
    path: Path
    tuned: dict  # an explicit arch's baked launches; {} for arch auto (each variant has its own)
    variants: tuple[BuiltVariant, ...] = ()  # arch auto: every arch's module, oldest first


def build(config_or_path: ConfigLike, out_dir: str | os.PathLike | None = None,
          tuned_dir: str | os.PathLike | None = None) -> Path:
    """Render one config, with the tuned launches found for it, and write its module; returns the path of
    the module to import (for `arch: auto`, the dispatcher: see build_files)."""
    return build_files(config_or_path, out_dir, tuned_dir).path


def build_files(config_or_path: ConfigLike, out_dir: str | os.PathLike | None = None,
                tuned_dir: str | os.PathLike | None = None) -> Built:
    """Render one config and write its files. An explicit arch gives one module; `arch: auto` is kept as it
    is (the build machine does not decide it) and gives one module per known arch, each exactly as an
    explicit-arch build of that arch, with its tuned launches, and the dispatcher over them."""
    from . import tuned_files

    config = config_or_path if isinstance(config_or_path, Config) else config_mod.load(config_or_path)
    out = Path(out_dir) if out_dir is not None else default_cache_dir()
    root = Path(tuned_dir) if tuned_dir is not None else default_tuned_dir()
    path = out / f"{config.artifact_name()}.py"
    if config.arch != "auto":
        tuned = tuned_files.baked_launches(root, config, _warn)
        _write(out, [(path, render(config, tuned))])
        return Built(path, tuned)
    variants = []
    for variant_config in dispatch.variant_configs(config):
        tuned = tuned_files.baked_launches(root, variant_config, _warn)
        variants.append(dispatch.Variant(variant_config, render(variant_config, tuned), tuned))
    files = [(out / variant.file_name, variant.source) for variant in variants]
    _write(out, files + [(path, dispatch.render_dispatcher(config, variants))])  # the dispatcher last
    return Built(path, {}, tuple(BuiltVariant(v.arch, out / v.file_name, v.tuned) for v in variants))


def _write(out: Path, files: list[tuple[Path, str]]) -> None:
    """Write the files of one build together (files.write_atomic_group), or say in one line why not."""
    make_folder(out)
    try:
        write_atomic_group([(path, source.encode("utf-8")) for path, source in files])
    except GroupWriteError as exc:
        raise TqgenError(f"the folder {out} cannot be written: {exc.path} cannot be created "
                         f"({write_failure_reason(exc.cause)})") from None


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """Runs the source bytes it is given, never a cached .pyc: Python trusts a .pyc while the file's size and
    mtime in whole seconds match, which a module rebuilt within the same second with as many bytes keeps."""

    def __init__(self, fullname: str, path: str, data: bytes):
        super().__init__(fullname, path)
        self._data = data

    def get_code(self, fullname):
        return self.source_to_code(self._data, self.path)


def import_module_file(path: str | os.PathLike) -> ModuleType:
    """Import a generated module file (cached by content, so a rebuilt file is re-imported)."""
    given, path = path, Path(path).resolve()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TqgenError(f"{given}: no such file, expected an emitted module (.py)") from None
    except IsADirectoryError:
        raise TqgenError(f"{given}: is a directory, expected an emitted module (.py)") from None
    except OSError as exc:
        raise TqgenError(f"{given}: cannot be read ({exc.strerror})") from None
    digest = hashlib.sha256(data).hexdigest()[:12]
    name = f"tqgen_generated.{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path, loader=_SourceLoader(name, str(path), data))
    if spec is None or spec.loader is None:
        raise TqgenError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load(config_or_path: ConfigLike, cache_dir: str | os.PathLike | None = None,
         tuned_dir: str | os.PathLike | None = None) -> ModuleType:
    """Import the module for a config (a Config, a YAML path, or an emitted .py file).

    Configs are rendered and written to `cache_dir` (default: `default_cache_dir()`)
    only when the file's bytes would change, then imported. `arch: auto` is resolved
    to this machine's GPU (sm80 without one): the module is built where it runs. An
    emitted file is imported as it is (a dispatcher picks its variant per device).
    """
    if not isinstance(config_or_path, Config) and str(config_or_path).endswith(".py"):
        return import_module_file(config_or_path)
    return import_module_file(build(as_config(config_or_path), cache_dir, tuned_dir))
