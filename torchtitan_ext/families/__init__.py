"""The model-family registry: one `Family` entry per family, read by every script, test and
the exporter (catalogue, parameter counts, FLOPs/MFU, Hugging Face export and import,
evaluation, the demo).

A family's entry lives beside its torchtitan glue (`torchtitan_ext/families/<family>.py`, as
`FAMILY`) and is listed once in `MODULES` below. Adding a family = a `models/` module (the
plain model and its config dataclass), a `torchtitan_ext/families/<family>.py` holding the `Family`
entry, a `train_configs/<family>.py` of config functions, and its name in `MODULES`;
`register()` adds an entry from anywhere else (a plugin, a test).

Flavors are named sizes in one style: keyword fields of the family's config dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

MODULES = ("transformer", "mlp_lm", "titans", "mela", "backbone", "gradmem")  # torchtitan_ext.families.<name>.FAMILY


@dataclass(frozen=True)
class Family:
    """Everything the project knows about one model family.

    name: the ModelSpec name (with `variant_field`: `<name>_<variant>` per variant) and the
    export's `family`; summary: one catalogue line; flavors: {flavor: config fields};
    config_class: the plain config dataclass; plain_class: the `models/` class (a remote-code
    export ships its source; None: the family builds its spec with `build_spec`);
    flops_per_token(config, seq_len): training FLOPs per token (None: 6 x parameters);
    diagnostics(model): `memory/...` metrics of the last forward, found through wrappers
    (logged by `MemoryTrainer`); hf_config(config): the transformers config of a family that
    exports as a standard transformers class, or None for a config that has none (remote
    code; the field None: the whole family exports as remote code); state_dict_adapter:
    torchtitan's adapter to Hugging Face keys, the class or "module:Class" imported when a
    spec is built (`adapter_class`; so that the plain model builds without torchtitan) (None:
    the export wrapper's `model.` prefix);
    check_hf_folder(config, folder): UserError unless a Hugging Face folder holds a model of
    `config`'s shape (preflight, before an initial load); check_config(trainer config):
    UserError for options the family cannot train under (preflight); config_module: the `train_configs`
    module (default `train_configs.<name>`); compile_regions(model, backend): how the family's
    training compiles a model in place of torchtitan's per-block compile (None: that one);
    compiled_modules(model): the names of the submodules that compile compiles, each on its
    own (None: torchtitan's per-block compile, every child of `model.layers`), which
    torchtitan_ext/step_cost/ costs as compiled and everything else as eager."""

    name: str
    summary: str
    flavors: Mapping[str, Mapping[str, Any]]
    config_class: type
    plain_class: type | None = None
    build_spec: Callable | None = None
    variant_field: str | None = None
    variants: tuple[str, ...] = ()
    flops_per_token: Callable | None = None
    diagnostics: Callable | None = None
    hf_config: Callable | None = None
    state_dict_adapter: type | str | None = None
    check_hf_folder: Callable | None = None
    check_config: Callable | None = None
    config_module: str = ""
    compile_regions: Callable | None = None
    compiled_modules: Callable | None = None

    def __post_init__(self):
        if not self.config_module:
            object.__setattr__(self, "config_module", f"train_configs.{self.name}")

    def config(self, flavor: str, **overrides):
        """The plain config of a flavor; `overrides` set any field (e.g. a Titans variant)."""
        if flavor not in self.flavors:
            raise ValueError(f"unknown {self.name} flavor '{flavor}': choose one of {sorted(self.flavors)}")
        return self.config_class(**(dict(self.flavors[flavor]) | overrides))

    def compiled_module_names(self, model) -> list[str]:
        """The submodules (names in `model.named_modules()`) the family's training compiles when
        compile is on: `compiled_modules`, else torchtitan's per-block compile (`apply_compile`:
        each child of `model.layers` with fullgraph=True; the rest of the model stays eager)."""
        if self.compiled_modules is not None:
            return list(self.compiled_modules(model))
        return [f"layers.{name}" for name, _ in model.layers.named_children()]

    def compile(self, model, backend: str = "inductor") -> None:
        """Compile `model` in place as the family's training does (`compile_regions`, else each
        of `compiled_module_names` with fullgraph=True, as torchtitan's per-block compile)."""
        if self.compile_regions is not None:
            self.compile_regions(model, backend)
            return
        for name in self.compiled_module_names(model):
            model.get_submodule(name).compile(backend=backend, fullgraph=True)

    def adapter_class(self) -> type | None:
        """The state-dict adapter class (`state_dict_adapter`, imported here when it is named)."""
        if not isinstance(self.state_dict_adapter, str):
            return self.state_dict_adapter
        module, name = self.state_dict_adapter.split(":")
        return getattr(importlib.import_module(module), name)

    def spec_name(self, config) -> str:
        return f"{self.name}_{getattr(config, self.variant_field)}" if self.variant_field else self.name

    def model_spec(self, flavor: str, **overrides):
        """torchtitan's ModelSpec of a flavor (a copy: callers may edit theirs)."""
        if self.build_spec is not None:
            return self.build_spec(flavor, **overrides)
        from torchtitan_ext.families.plain_model import plain_model_spec, torchtitan_model

        config = self.config(flavor, **overrides)
        model_cls = torchtitan_model(self.plain_class, self.config_class, self.flops_per_token)
        return plain_model_spec(self.spec_name(config), flavor, model_cls, dataclasses.replace(config),
                                self.adapter_class())

    def specs(self):
        """(ModelSpec name, flavor, overrides) of every variant and flavor."""
        for variant in self.variants or (None,):
            overrides = {self.variant_field: variant} if variant else {}
            for flavor in self.flavors:
                yield (f"{self.name}_{variant}" if variant else self.name), flavor, overrides

    @property
    def remote_export(self) -> bool:
        return self.hf_config is None

    def nested_configs(self) -> dict[str, type]:
        """{config field: dataclass} of the config's fields that hold dataclasses (rebuilt on import)."""
        defaults = self.config_class()
        return {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(self.config_class)
                if dataclasses.is_dataclass(getattr(defaults, f.name))}


_registered: dict[str, Family] = {}


@functools.cache
def _built_in() -> dict[str, Family]:
    return {f.name: f for f in (importlib.import_module(f"torchtitan_ext.families.{m}").FAMILY for m in MODULES)}


def families() -> dict[str, Family]:
    """{name: Family} of the built-in families and those added by `register`."""
    return _built_in() | _registered


def register(family: Family) -> None:
    """Add a family from outside this package (a plugin or a test); `unregister` removes it."""
    if family.name in families():
        raise ValueError(f"model family '{family.name}' is already registered")
    _registered[family.name] = family


def unregister(name: str) -> None:
    _registered.pop(name, None)


def family_of_spec(spec_name: str) -> Family:
    """The family of a ModelSpec name (`mela`, `titans_mac`, ...); ValueError if none."""
    for family in families().values():
        if spec_name == family.name or (family.variant_field and spec_name in
                                         {f"{family.name}_{v}" for v in family.variants}):
            return family
    raise ValueError(f"model '{spec_name}' belongs to no registered family: add a Family entry "
                     "(torchtitan_ext/families/__init__.py)")


def family_and_overrides(name: str) -> tuple[Family, dict]:
    """(Family, config overrides) of "<family>[_<variant>]" (e.g. "titans_mac": the titans
    family with its variant field set to "mac"); ValueError naming the choices if none."""
    for family in families().values():
        if name == family.name or name.startswith(family.name + "_"):
            variant = name[len(family.name) + 1:]
            if variant and variant not in family.variants:
                raise ValueError(f"'{name}': {family.name} has variants {family.variants}")
            return family, ({family.variant_field: variant} if variant else {})
    raise ValueError(f"unknown model '{name}': one of {sorted(families())}, with a variant where it has them")


def family_of_config(config) -> Family:
    """The family whose config dataclass `config` is."""
    for family in families().values():
        if type(config) is family.config_class:
            return family
    raise ValueError(f"{type(config).__name__} is the config of no registered family")


def family_of_config_function(function: str) -> Family:
    """The family whose train_configs module defines `function` (e.g. `titans_mac_debug`)."""
    for family in families().values():
        if hasattr(importlib.import_module(family.config_module), function):
            return family
    raise ValueError(f"no registered family has a config function '{function}': "
                     "`python -m torchtitan_ext.catalogue` lists them")

