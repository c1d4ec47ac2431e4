"""``"fastmoe"`` made known to transformers: registered in its experts interface as soon as that is
imported, the ``fastmoe_expert_precision`` field on every config, the choice kept by
``save_pretrained`` in a form that loads without this package, and one warning where a family's
experts would never call it (:func:`check_where_fastmoe_runs`). The experts function itself is
:mod:`.experts`."""
from __future__ import annotations

from typing import Any

from .experts import NAME, PRECISION_ATTRIBUTE, _PrecisionField, fastmoe_experts_forward

#: The module that defines transformers' config base class; ``from_pretrained`` parses its keywords
#: there, before the model's module (and the experts interface) is imported.
CONFIG_MODULE = "transformers.configuration_utils"


def _config_base(module: Any = None) -> Any:
    """transformers' config base class, from ``module`` (its defining module) or imported; None
    without transformers."""
    if module is None:
        try:
            import importlib

            module = importlib.import_module(CONFIG_MODULE)
        except ImportError:
            return None
    return getattr(module, "PreTrainedConfig", None) or getattr(module, "PretrainedConfig", None)


def accept_precision_in_configs(module: Any = None) -> bool:
    """Give transformers' config base class the :data:`PRECISION_ATTRIBUTE` field (once). Returns
    False when transformers is not installed."""
    cls = _config_base(module)
    if cls is None:
        return False
    if not isinstance(cls.__dict__.get(PRECISION_ATTRIBUTE), _PrecisionField):
        setattr(cls, PRECISION_ATTRIBUTE, _PrecisionField())
    return True


def register(interface: Any = None) -> bool:
    """Add :data:`NAME` to transformers' ``ALL_EXPERTS_FUNCTIONS`` (or ``interface``). Returns False,
    with nothing changed, when transformers is not installed; raises ImportError with the reason
    when the installed transformers predates the experts interface."""
    if interface is None:
        try:
            import transformers
        except ImportError:
            return False
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as interface
        except ImportError as err:
            raise ImportError(
                f"transformers {transformers.__version__} has no experts interface "
                "(transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS, transformers >= 5): the 'fastmoe' experts "
                "implementation needs it; FastSparseMoeBlock and patch_olmoe work without it"
            ) from err
    interface.register(NAME, fastmoe_experts_forward)
    record_in_saved_configs()
    accept_precision_in_configs()
    check_where_fastmoe_runs()
    return True


#: The key under which ``config.json`` keeps the choice of :data:`NAME`. transformers takes a key it
#: does not know as a plain attribute, so a saved model loads where ``fastmoe_xpu`` is not imported
#: (with transformers' default experts implementation, the same numbers); where it is imported, the
#: key brings :data:`NAME` back.
SAVED_CHOICE_KEY = "fastmoe_experts_implementation"


class _SavedChoiceField:
    """:data:`SAVED_CHOICE_KEY` on every transformers config: reads :data:`NAME` when that is the
    config's experts implementation, else None. Set from a loaded ``config.json`` (transformers sets
    every unknown key as an attribute, after the public ``experts_implementation``), it makes
    :data:`NAME` the choice unless one was given (an explicit ``from_pretrained(...,
    experts_implementation=...)`` is applied after the config is built, so it still wins)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return NAME if obj.__dict__.get("_experts_implementation_internal") == NAME else None

    def __set__(self, obj: Any, value: Any) -> None:
        if value == NAME and obj.__dict__.get("_experts_implementation_internal") is None:
            obj._experts_implementation = NAME

    def __delete__(self, obj: Any) -> None:
        pass


def record_in_saved_configs(module: Any = None) -> bool:
    """Make ``save_pretrained`` keep the choice of :data:`NAME`, in a form that loads anywhere.

    transformers drops its internal ``_experts_implementation`` when it writes ``config.json``, so
    a model saved with ``"fastmoe"`` would come back as ``grouped_mm`` without a word; writing the
    public key ``experts_implementation: "fastmoe"`` instead would make the checkpoint fail to load
    wherever this package is not imported. A config whose experts implementation is :data:`NAME`
    therefore writes :data:`SAVED_CHOICE_KEY`, which :class:`_SavedChoiceField` reads back. Other
    implementations are saved unchanged. Returns False when transformers' config class cannot be
    patched."""
    PretrainedConfig = _config_base(module)
    if PretrainedConfig is None:
        return False
    if not isinstance(PretrainedConfig.__dict__.get(SAVED_CHOICE_KEY), _SavedChoiceField):
        setattr(PretrainedConfig, SAVED_CHOICE_KEY, _SavedChoiceField())
    to_dict = PretrainedConfig.to_dict
    if getattr(to_dict, "_keeps_fastmoe", False):
        return True

    def to_dict_keeping_fastmoe(self: Any) -> dict[str, Any]:
        out = to_dict(self)
        out.pop(SAVED_CHOICE_KEY, None)
        if getattr(self, "_experts_implementation_internal", None) == NAME:
            out[SAVED_CHOICE_KEY] = NAME
        return out

    to_dict_keeping_fastmoe._keeps_fastmoe = True  # type: ignore[attr-defined]
    to_dict_keeping_fastmoe.__doc__ = to_dict.__doc__
    PretrainedConfig.to_dict = to_dict_keeping_fastmoe  # type: ignore[method-assign]
    return True


#: The module that defines transformers' model base class.
MODEL_MODULE = "transformers.modeling_utils"
#: What was said once already by :func:`check_where_fastmoe_runs` (one warning per family and case).
_WARNED: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)


def _family(model: Any) -> str:
    return getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__


def check_where_fastmoe_runs(module: Any = None) -> bool:
    """Make transformers' choice of an experts implementation say when :data:`NAME` would not run.

    A family whose experts transformers does not route through ``@use_experts_implementation``
    (Llama4-text, JetMoE, ...) accepted ``experts_implementation="fastmoe"`` and never called it,
    and its saved config then named it. Such a model now runs what it runs anyway, its own experts
    (``"eager"``), with one warning naming the family; ``set_experts_implementation`` says the same.
    A config that asks for quantized expert GEMMs (``fastmoe_expert_precision``) on another
    implementation is warned once too: only the fastmoe experts quantize. Returns False where
    transformers' model class lacks the hook (nothing changed)."""
    if module is None:
        try:
            import importlib

            module = importlib.import_module(MODEL_MODULE)
        except ImportError:
            return False
    cls = getattr(module, "PreTrainedModel", None)
    choose = getattr(cls, "get_correct_experts_implementation", None)
    if choose is None or not hasattr(cls, "_can_set_experts_implementation"):
        return False
    if getattr(choose, "_checks_fastmoe", False):
        return True

    def get_correct_experts_implementation(self: Any, requested: Any) -> Any:
        name = type(self).__name__
        if requested == NAME and not type(self)._can_set_experts_implementation():
            try:
                import inspect

                mentions_experts = "expert" in inspect.getsource(inspect.getmodule(type(self))).lower()
            except (OSError, TypeError):
                mentions_experts = True
            if mentions_experts:
                _warn_once((_family(self), "not run"), (
                    f'experts_implementation="{NAME}" does not run in {name} ({_family(self)}): transformers does not '
                    f"route this family's experts through @use_experts_implementation, so its own experts run "
                    f'("eager"); the fastmoe experts run in the families docs/families.md lists'))
            requested = "eager"
        chosen = choose(self, requested)
        precision = getattr(getattr(self, "config", None), PRECISION_ATTRIBUTE, None)
        if precision is not None and chosen != NAME:
            _warn_once((_family(self), "precision"), (
                f"{PRECISION_ATTRIBUTE}={precision!r} has no effect on {name}: its experts run {chosen!r} at the "
                f'weights\' precision; only experts_implementation="{NAME}" quantizes them'))
        return chosen

    get_correct_experts_implementation._checks_fastmoe = True  # type: ignore[attr-defined]
    get_correct_experts_implementation.__doc__ = choose.__doc__
    cls.get_correct_experts_implementation = get_correct_experts_implementation
    return True


#: The module that defines transformers' experts interface; every use of an experts implementation
#: name (``from_pretrained``/``from_config``/``set_experts_implementation``) imports it first.
INTERFACE_MODULE = "transformers.integrations.moe"


class _RegisterAfterExec:
    """A module's own loader, with the callbacks waiting for it run right after the module body."""

    def __init__(self, inner: Any, finder: "_RegisterOnImport") -> None:
        self._inner, self._finder = inner, finder

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        self._finder.remove()
        _run_callbacks(self._finder.fullname, module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, resources, ...
        return getattr(self._inner, name)


class _RegisterOnImport:
    """A ``sys.meta_path`` finder that runs the callbacks waiting for the module ``fullname`` right
    after it executes, then removes itself. For :data:`INTERFACE_MODULE` that registers
    :data:`NAME`: the experts interface is filled in that module's body, and transformers checks
    ``experts_implementation`` against it, so every path to a model that asks for the name imports it
    first: registration is in place before any use, while ``import fastmoe_xpu`` no longer pays for
    importing transformers' MoE module. For :data:`CONFIG_MODULE` it adds the precision field."""

    def __init__(self, fullname: str = INTERFACE_MODULE) -> None:
        self.fullname = fullname

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        import sys

        if fullname != self.fullname:
            return None
        for finder in list(sys.meta_path):  # whichever finder would have found it
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            # cannot run after the body: register the moment this finder is asked, from the real
            # module imported by the normal machinery (this finder stepping aside first)
            self.remove()
            import importlib

            _run_callbacks(fullname, importlib.import_module(fullname))
            return None
        spec.loader = _RegisterAfterExec(spec.loader, self)
        return spec

    def remove(self) -> None:
        import sys

        if self in sys.meta_path:
            sys.meta_path.remove(self)


_CALLBACKS: dict[str, list[Any]] = {}


def _run_callbacks(fullname: str, module: Any) -> None:
    waiting = _CALLBACKS.get(fullname, [])
    while waiting:
        waiting.pop(0)(module)


def when_imported(fullname: str, fn: Any) -> None:
    """Call ``fn(module)`` now if the module ``fullname`` is imported, else right after it is."""
    import sys

    mod = sys.modules.get(fullname)
    if mod is not None:
        fn(mod)
        return
    _CALLBACKS.setdefault(fullname, []).append(fn)
    if not any(isinstance(f, _RegisterOnImport) and f.fullname == fullname for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport(fullname))


def when_interface_imported(fn: Any) -> None:
    """Call ``fn(transformers.integrations.moe)`` now if that module is imported, else right after it is."""
    when_imported(INTERFACE_MODULE, fn)


def register_lazily() -> str:
    """Register :data:`NAME` now when transformers' experts interface is already imported (or when
    transformers is too old to have one: :func:`register` then raises its ImportError), else as soon as
    it is imported. Returns ``"now"``, ``"on import"`` or ``"absent"`` (no transformers installed)."""
    import importlib.util
    import sys

    if INTERFACE_MODULE in sys.modules:
        register()
        return "now"
    try:
        from importlib.metadata import version

        major = int(version("transformers").split(".")[0])
    except Exception:  # not installed (or no metadata): decide by importing, as before
        return "absent" if importlib.util.find_spec("transformers") is None else _eager()
    if major < 5:
        return _eager()  # raises the ImportError naming the version
    # from_pretrained(..., fastmoe_expert_precision=...) is parsed by the config class, before the
    # experts interface is imported
    # and a saved config.json's choice is read back (record_in_saved_configs) at the same point
    when_imported(CONFIG_MODULE, accept_precision_in_configs)
    when_imported(CONFIG_MODULE, record_in_saved_configs)
    when_imported(MODEL_MODULE, check_where_fastmoe_runs)
    when_interface_imported(lambda mod: register(mod.ALL_EXPERTS_FUNCTIONS))
    return "on import"


def _eager() -> str:
    return "now" if register() else "absent"
