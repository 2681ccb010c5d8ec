"""What the served ``deepspeed.initialize`` reads from its arguments before deepcompile's own
config parsing: the config as a dict, the top-level keys DeepSpeed would ignore, the ZeRO stage
asked for, and whether the engine will ever train.

DeepSpeed tolerates configs that ``deepcompile.initialize`` rightly refuses (TRL's reference
model config carries ``"zero_optimization.reduce_bucket_size"``-style keys at top level, which
DeepSpeed never reads). Only the served entry point relaxes them, so the direct API stays strict.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Mapping, Optional

from deepcompile.config.root import load_json_object


def as_dict(cfg: Any) -> Any:
    """A dict for a dict or a JSON file path (a copy: the caller's dict is never changed);
    anything else (a :class:`deepcompile.Config`) as is."""
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if isinstance(cfg, (str, os.PathLike)):
        return load_json_object(cfg)
    return cfg


def drop_dotted_keys(cfg: Any) -> Any:
    """``cfg`` without its top-level keys whose name contains a dot, with one warning naming them.

    DeepSpeed reads a config by section and never looks at such keys, so a client that writes
    them (TRL's ``prepare_deepspeed`` at ZeRO-3, meaning them as overrides of the section's
    values) runs with the section's own values; deepcompile does the same rather than refuse."""
    if not isinstance(cfg, dict):
        return cfg
    dotted = sorted(k for k in cfg if isinstance(k, str) and "." in k)
    if not dotted:
        return cfg
    warnings.warn(f"deepspeed.initialize: ignoring top-level config keys {dotted} (as DeepSpeed does: a dotted "
                  "name is not a key of any section; set the value inside its section to have it read)",
                  stacklevel=3)
    return {k: v for k, v in cfg.items() if k not in dotted}


def zero_stage(cfg: Any) -> Optional[Any]:
    """``zero_optimization.stage`` as written; 0 without a ``zero_optimization`` section or
    without a stage in it (DeepSpeed's default); None for a parsed Config (never stage 0)."""
    if not isinstance(cfg, dict):
        return None
    section = cfg.get("zero_optimization")
    if section is None:
        return 0
    if isinstance(section, Mapping):
        return section.get("stage", 0)
    return None  # malformed: deepcompile's parser says so


def has_no_optimizer(cfg: Any, optimizer: Any, model_parameters: Any, lr_scheduler: Any) -> bool:
    """True when nothing could ever step the engine: no optimizer object, no ``optimizer``
    section, no scheduler, and no parameters to train (None, or an empty list as Lightning's
    inference path passes). A generator of parameters counts as parameters: it is not consumed
    here."""
    no_parameters = model_parameters is None or (isinstance(model_parameters, (list, tuple))
                                                 and len(model_parameters) == 0)
    if isinstance(cfg, dict):
        in_config = cfg.get("optimizer") is not None
    else:
        in_config = getattr(cfg, "optimizer", None) is not None
    return optimizer is None and lr_scheduler is None and no_parameters and not in_config


def for_checking(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A stage-0 config as deepcompile's parser can read it (which knows stages 1 to 3 only):
    stage 3, whose keys are a superset of the others', so every other key is still checked."""
    out = dict(cfg)
    section = dict(out.get("zero_optimization") or {})
    section["stage"] = 3
    out["zero_optimization"] = section
    return out
