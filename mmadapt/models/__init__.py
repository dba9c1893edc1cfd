"""The model families (family.py's seam), registered by name: `ModelConfig.family` picks one.

    roberta   post-LayerNorm encoder, masked LM (the paper's models; mmadapt/models/roberta/)
    llama     pre-norm decoder (Llama, Qwen2, Mistral), causal LM (mmadapt/models/llama/)
    bert      RoBERTa's encoder with token types and BERT's framing (mBERT, MiniLM, LaBSE) (mmadapt/models/bert/)

A family defined outside mmadapt registers itself (`register_family`) when its module is
imported; the environment variable MMADAPT_IMPORT names such modules (comma-separated, importable
from sys.path; `module:function` calls a function that registers them), as torchtitan's
`--experimental.custom_import` does. Every command imports them before it parses its flags
(cli.user_errors), and `get_family` does before it calls a name unknown, so that a run of that
family can be started, read and continued by every command, the Python API and DeepSpeed's
ranks, which inherit the environment.

Each family brings its presets (a model size and its schedule, `ModelFamily.presets`); preset
names are unique across families, so a preset names its family too (`find_preset`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from mmadapt.config import ModelConfig, TrainConfig
from mmadapt.family import ModelFamily
from mmadapt.models.bert import BERT
from mmadapt.models.llama import LLAMA
from mmadapt.models.roberta import ROBERTA

FAMILIES: dict[str, ModelFamily] = {}
# Every registered family's presets: name -> (model config, schedule).
PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {}
IMPORT_VARIABLE = "MMADAPT_IMPORT"
# What a family defines itself (ModelFamily's raise NotImplementedError): docs/model-families.md's list
REQUIRED_METHODS = ("build_lm", "build_task_model", "build_body", "finetune_trainable", "step_flops")
REQUIRED_ATTRIBUTES = ("objective", "task_kinds")  # (ModelFamily's annotations without a value)


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` buildable by name (a run.json whose model config names it) and its presets
    choosable. Refused (ValueError) when it has no name, does not define REQUIRED_METHODS, or
    another family has its name (a registered family, mmadapt's own included, was replaced
    without a word; the same one again is no change, and its class defined again replaces it),
    when a preset name is taken by another family, when its small preset is not one of its
    presets, or when a preset's config names another family, or a class given (as a decorator)
    where its instance is meant."""
    if isinstance(family, type):  # (its methods then went unchecked: they are the class's either way)
        raise ValueError(f"register_family takes a family, an instance: register_family({family.__name__}()), not "
                         f"the class {family.__name__}")
    name = getattr(family, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{type(family).__name__} has no name (a class attribute `name = \"...\"`): runs and "
                         "presets name their family by it")
    unset = [a for a in REQUIRED_ATTRIBUTES if not hasattr(family, a)]
    if unset:  # (an AttributeError in the middle of a run's start)
        raise ValueError(f"the {name} family ({type(family).__name__}) does not set {', '.join(unset)}: every family "
                         f"sets {', '.join(REQUIRED_ATTRIBUTES)} (docs/model-families.md)")
    missing = [m for m in REQUIRED_METHODS if getattr(type(family), m, None) is getattr(ModelFamily, m)]
    if missing:  # (each raised a NotImplementedError with no text, after a run had written its directory)
        raise ValueError(f"the {name} family ({type(family).__name__}) does not define {', '.join(missing)}: every "
                         f"family defines {', '.join(REQUIRED_METHODS)} (docs/model-families.md)")
    old = FAMILIES.get(name, family)
    if old is not family and _defined_at(old) != _defined_at(family):
        raise ValueError(f"{type(family).__name__}'s name {name!r} is the name of a family registered already "
                         f"({type(old).__name__}, {type(old).__module__}): choose another name")
    taken = {name: f.name for f in FAMILIES.values() if f.name != family.name for name in f.presets}
    clash = next((n for n in family.presets if n in taken), None)
    if clash is not None:
        raise ValueError(f"the {family.name} family's preset {clash!r} is the {taken[clash]} family's already: "
                         "preset names are unique across families")
    if getattr(family, "small_preset", None) not in family.presets:
        raise ValueError(f"the {family.name} family's small_preset {getattr(family, 'small_preset', None)!r} is not "
                         f"one of its presets ({', '.join(family.presets) or 'none'}): later steps run it by default")
    alien = next((n for n, (m, _) in family.presets.items() if m.family != family.name), None)
    if alien is not None:
        raise ValueError(f"the {family.name} family's preset {alien!r} has ModelConfig.family "
                         f"{family.presets[alien][0].family!r}")
    for dropped in old.presets if old is not family else ():  # its class defined again (a notebook
        PRESETS.pop(dropped, None)  # cell run twice, a module reloaded): this one replaces it
    FAMILIES[family.name] = family
    PRESETS.update(family.presets)
    return family


def _defined_at(family: ModelFamily) -> tuple[str, str]:
    return type(family).__module__, type(family).__qualname__


def get_family(name_or_config: str | ModelConfig) -> ModelFamily:
    """The family of a name or of a model config (ValueError naming the known ones)."""
    name = name_or_config.family if isinstance(name_or_config, ModelConfig) else name_or_config
    if name not in FAMILIES:
        import_plugins()
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; mmadapt has {', '.join(sorted(FAMILIES))} (a family defined "
                         f"outside mmadapt is registered by importing its module: {IMPORT_VARIABLE}=<module>)")
    return FAMILIES[name]


def find_preset(name: str) -> tuple[ModelFamily, ModelConfig, TrainConfig]:
    """-> (its family, model config, schedule) of the preset `name` (ValueError naming the known ones)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    model, train = PRESETS[name]
    return FAMILIES[model.family], model, train


def import_plugins(spec: str | None = None) -> None:
    """Import the modules named by MMADAPT_IMPORT (or `spec`), comma-separated: `module`, which
    registers its families when imported, or `module:function`, whose function (called with no
    arguments) registers them. One that cannot be imported is one line naming it."""
    for item in filter(None, (m.strip() for m in (os.environ.get(IMPORT_VARIABLE, "") if spec is None
                                                   else spec).split(","))):
        if item in _IMPORTED:
            continue
        module, _, function = item.partition(":")
        if not all(module.split(".")):  # '.fam' (relative: import_module's TypeError), '', 'a..b'
            raise ValueError(f"{IMPORT_VARIABLE}: {item!r} does not name a module: give its full dotted name "
                             "(acme.families or acme.families:register)")
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as e:
            line = _missing_import(e, module, module)
            if line is not None:
                raise ValueError(line) from e
            if e.name is None:  # raised by the module's own code (an optional dependency's check): it was found
                raise ValueError(_failed(f"importing {module}", e, "the module")) from e
            raise ValueError(f"{IMPORT_VARIABLE}: cannot import {module} ({e}): put its directory on PYTHONPATH, "
                             "or fix the module name") from None
        except ValueError as e:  # register_family's refusal (or the module's own), said as coming from it
            raise ValueError(f"{IMPORT_VARIABLE}: importing {module}: {e}") from e
        except Exception as e:  # the user's module: a mistake in it is one line, not mmadapt's traceback
            raise ValueError(_failed(f"importing {module}", e, "the module")) from e
        if function:
            if not callable(getattr(loaded, function, None)):
                raise ValueError(f"{IMPORT_VARIABLE}: {module} has no function {function} to register its families")
            try:
                getattr(loaded, function)()
            except ValueError as e:
                raise ValueError(f"{IMPORT_VARIABLE}: {module}:{function}(): {e}") from e
            except ModuleNotFoundError as e:  # an import inside the function: as the module's own imports are said
                said = f"{module}:{function}()"
                raise ValueError(_missing_import(e, module, said) or _failed(said, e, "it")) from e
            except Exception as e:
                raise ValueError(_failed(f"{module}:{function}()", e, "it")) from e
        _IMPORTED.add(item)


_IMPORTED: set[str] = set()  # what import_plugins has imported in this process


def _failed(said: str, e: Exception, fix: str) -> str:
    """The line for a plugin module (or its function) that raised `e` itself: a mistake in it."""
    return f"{IMPORT_VARIABLE}: {said} failed ({type(e).__name__}: {e}): fix {fix} (MMADAPT_DEBUG=1 shows where)"


def _missing_import(e: ModuleNotFoundError, module: str, said: str) -> str | None:
    """The line for `module` (said as `said`), found, whose import of another module (e.name)
    failed: a module of its own regular package, misnamed (fix that import), else one to install;
    None where `module` itself was not found, or the error names no module."""
    if e.name is None or e.name == module or module.startswith(e.name + "."):
        return None
    package = _shared_package(module, e.name)  # acme.mmfamily of acme.mmfamily.{families,helpers_typo}
    if package and _regular_package(package):
        return f"{IMPORT_VARIABLE}: {said} imports {e.name}, which {package} does not have: fix that import"
    return f"{IMPORT_VARIABLE}: {said} imports {e.name}, which is not installed: install it"


def _shared_package(module: str, missing: str | None) -> str:
    """The deepest package holding both `module` and the `missing` module it imports ('' where
    none does)."""
    shared = []
    for a, b in zip(module.split("."), (missing or "").split(".")[:-1]):
        if a != b:
            break
        shared.append(a)
    return ".".join(shared)


def _regular_package(name: str) -> bool:
    """Whether `name` is a package of one directory (an __init__.py): a namespace package's
    (google.*, a company's acme.*) other modules come from other distributions, to install."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")

register_family(ROBERTA)
register_family(LLAMA)
register_family(BERT)
