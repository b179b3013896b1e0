"""arch auto: one module per known arch, and a dispatcher module that runs each call in the right one.

A build must not depend on the machine it runs on: a CI machine without a GPU builds what an H200
serves. So an `arch: auto` config is rendered once per arch the renderer knows (config.KNOWN_ARCHES),
each exactly as an explicit-arch build renders it, with that arch's tuned launches baked, plus a
dispatcher named by the artifact without the arch (templates/dispatcher.py.jinja). The dispatcher
imports a variant by path, beside itself, when a device first needs it, and caches the choice per
device, so a call costs one dict lookup more than calling the variant.

The dispatcher's API is derived from the rendered variants (`Api.of`), never kept by hand:
- functions and classes are forwarded per call, to the variant for the device of the call's
  `device` argument if it has one, else of its `kv_cache` (the launchers run where the cache is),
  else of its first argument if that is a tensor, else of the current device (`Route`);
- exception classes are the sm80 variant's, installed in every variant, so that one
  `except tq.LaunchError` catches each variant's refusals;
- constants defined alike in every variant are read from the sm80 variant (importing a module
  compiles no kernel); constants that differ (TUNED_LAUNCHES), or that some variants lack, and the
  Triton kernels are read from the current device's variant;
- CONFIG and CONFIG_HASH are the dispatcher's own: the config it was built from, arch "auto".
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import hashlib
import json
import pprint
from typing import Any, Sequence

from . import __version__, render
from .config import KNOWN_ARCHES, Config, arch_capability

PORTABLE_ARCH = KNOWN_ARCHES[0]  # sm80: runs on every GPU the kernels support, and in the interpreter
# Names the dispatcher defines for itself (the config it was built from) and those it adds to the API.
OWN_NAMES = ("CONFIG", "CONFIG_HASH")
DISPATCHER_NAMES = ("VARIANTS", "variant_for")


def variant_configs(config: Config) -> list[Config]:
    """The config at each known arch, oldest first: the variants of an arch-auto build."""
    if config.arch != "auto":
        raise ValueError(f"variants exist for arch 'auto' only, not {config.arch!r}")
    return [dataclasses.replace(config, arch=arch) for arch in KNOWN_ARCHES]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One arch's module of an arch-auto build: its config, rendered source and baked tuned launches."""
    config: Config
    source: str
    tuned: dict

    @property
    def arch(self) -> str:
        return self.config.arch

    @property
    def file_name(self) -> str:
        return f"{self.config.artifact_name()}.py"


@dataclasses.dataclass(frozen=True)
class Route:
    """How a forwarded function or class finds the device whose variant runs a call: by its `device`
    argument ("device", with that argument's position and default), by its `kv_cache` argument, else its first
    argument ("tensor": the tensor's device, else the current device), or by the current device ("current": no
    arguments)."""
    name: str
    kind: str  # "function" or "class"
    by: str
    position: int | None = None  # None: keyword-only
    keyword: str = ""
    default: Any = None

    def argument(self) -> str:
        """The expression, in a forwarding function of (*args, **kwargs), of the argument that routes."""
        fallback = f"kwargs.get({self.keyword!r}{'' if self.default is None else f', {self.default!r}'})"
        if self.position is None:
            return fallback
        if self.position == 0:
            return f"args[0] if args else {fallback}"
        return f"args[{self.position}] if len(args) > {self.position} else {fallback}"

    def variant(self) -> str:
        """The expression that picks the variant for a call."""
        if self.by == "current":
            return "variant_for()"
        return f"_on_{self.by}({self.argument()})"


def _route(name: str, kind: str, arguments: ast.arguments, skip_first: bool) -> Route:
    positional = arguments.posonlyargs + arguments.args
    positional = positional[1:] if skip_first else positional  # a class's __init__: self
    defaults = dict(zip([a.arg for a in positional][len(positional) - len(arguments.defaults):], arguments.defaults))
    defaults.update((a.arg, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None)
    names = [a.arg for a in positional]
    if "device" in names or "device" in [a.arg for a in arguments.kwonlyargs]:
        default = defaults.get("device")
        try:
            value = None if default is None else ast.literal_eval(default)
        except ValueError:
            raise ValueError(f"{name}: the default of its device argument is not a literal") from None
        position = names.index("device") if "device" in names else None
        return Route(name, kind, "device", position, "device", value)
    # A launcher runs where its cache is (it makes the cache's device current and checks every other tensor
    # against it): routed by the query or key, a call spread over GPUs of two archs had the cache's device refused
    # by the other device's variant as too old for it, rather than the misplaced argument named.
    if "kv_cache" in names:
        return Route(name, kind, "tensor", names.index("kv_cache"), "kv_cache")
    if names:
        return Route(name, kind, "tensor", 0, names[0])
    return Route(name, kind, "current")


def _is_kernel(node: ast.FunctionDef) -> bool:
    """@triton.jit, @gluon.jit, with or without arguments."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _is_exception(node: ast.ClassDef) -> bool:
    bases = [getattr(builtins, base.id, None) for base in node.bases if isinstance(base, ast.Name)]
    return any(isinstance(base, type) and issubclass(base, BaseException) for base in bases)


@dataclasses.dataclass(frozen=True)
class Api:
    """The public names of the variants (every name without a leading underscore that is not an imported
    module), by how the dispatcher provides each."""
    routes: tuple[Route, ...]
    exceptions: tuple[str, ...]
    shared: tuple[str, ...]  # constants defined alike in every variant
    per_variant: tuple[str, ...]  # constants that differ or that some variants lack, and the kernels
    constants: tuple[str, ...]  # every constant, shared or not (assignable through the dispatcher)

    @property
    def names(self) -> list[str]:
        """Every public name of the dispatcher: the variants' and its own."""
        own = [route.name for route in self.routes] + list(self.exceptions) + list(self.shared)
        return sorted(set(own) | set(self.per_variant) | set(OWN_NAMES) | set(DISPATCHER_NAMES))

    @classmethod
    def of(cls, sources: Sequence[str]) -> "Api":
        """The API of variants' sources, oldest arch first (constants shared by all come from the first)."""
        found: dict[str, list[list[ast.stmt]]] = {}
        for source in sources:
            for name, nodes in render._definitions(ast.parse(source)).items():
                if not name.startswith("_") and name not in OWN_NAMES:
                    found.setdefault(name, []).append(nodes)
        routes, exceptions, shared, per_variant, constants = {}, [], [], [], []
        for name, definitions in sorted(found.items()):
            node = definitions[0][-1]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            alike = len(definitions) == len(sources) and len({_text(nodes) for nodes in definitions}) == 1
            if isinstance(node, ast.FunctionDef) and _is_kernel(node):
                per_variant.append(name)
            elif isinstance(node, ast.FunctionDef):
                routes[name] = {_route(name, "function", nodes[-1].args, False) for nodes in definitions}
            elif isinstance(node, ast.ClassDef) and _is_exception(node):
                exceptions.append(name)
            elif isinstance(node, ast.ClassDef):
                inits = [[n for n in nodes[-1].body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
                         for nodes in definitions]
                routes[name] = {_route(name, "class", init[0].args, True) if init else Route(name, "class", "current")
                                for init in inits}
            else:
                constants.append(name)
                (shared if alike else per_variant).append(name)
        differing = sorted(name for name, found_routes in routes.items() if len(found_routes) > 1)
        if differing:
            raise ValueError(f"the variants route {', '.join(differing)} differently (their signatures differ)")
        return cls(tuple(route for (route,) in routes.values()), tuple(exceptions), tuple(shared),
                   tuple(per_variant), tuple(constants))


def _text(nodes: list[ast.stmt]) -> str:
    return "".join(render._canonical(node) for node in nodes)


def _tuning(tuned: dict) -> str:
    if not tuned:
        return "none (the heuristic)"
    return "; ".join(f"{device}: {len(entry['buckets'])} buckets" for device, entry in sorted(tuned.items()))


def render_dispatcher(config: Config, variants: Sequence[Variant]) -> str:
    """The dispatcher's source for an arch-auto config over its rendered variants (oldest arch first)."""
    if config.arch != "auto" or [v.arch for v in variants] != list(KNOWN_ARCHES):
        raise ValueError("a dispatcher is rendered for an arch-auto config over one variant per known arch")
    api = Api.of([variant.source for variant in variants])
    if "LaunchError" not in api.exceptions:  # the dispatcher raises it for a device older than every variant
        raise ValueError("the variants define no LaunchError")
    rows = [(v.arch, v.file_name, arch_capability(v.arch), _tuning(v.tuned),
             hashlib.sha256(v.source.encode("utf-8")).hexdigest()) for v in variants]
    template = render._environment().get_template(render.DISPATCHER_TEMPLATE)
    source = template.render(
        version=__version__, config=config, config_hash=config.hash(), api=api, variants=rows,
        portable=PORTABLE_ARCH,
        config_items=[(k, json.dumps(v)) for k, v in config.to_dict().items() if v is not None],
        config_literal=pprint.pformat(config.to_dict(), width=100, sort_dicts=True),
    )
    source = render._tidy(source)
    compile(source, f"<{config.artifact_name()}>", "exec")  # a template bug fails here, not at import
    return source
