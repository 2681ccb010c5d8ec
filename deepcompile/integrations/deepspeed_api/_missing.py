"""The error for the parts of DeepSpeed's surface deepcompile does not implement.

An AttributeError (so that ``hasattr`` and ``getattr(..., default)`` probes by the calling
library keep working) whose message names what was asked for, instead of a bare missing name.
"""


class NotImplementedByDeepcompile(AttributeError):
    pass


def missing(what: str) -> NotImplementedByDeepcompile:
    return NotImplementedByDeepcompile(
        f"deepcompile does not implement {what} (deepcompile.serve_as_deepspeed() provides only the part of "
        "DeepSpeed that Hugging Face Trainer and accelerate use; docs/huggingface.md lists it)")


def module_getattr(module_name: str):
    """A module-level ``__getattr__`` that refuses every name the module does not define."""

    def __getattr__(name: str):
        if name.startswith("__"):  # dunder probes (__path__, __file__, ...) stay ordinary misses
            raise AttributeError(name)
        raise missing(f"{module_name}.{name}")

    return __getattr__


class RefusedByDeepcompile(NotImplementedError):
    pass


def refused(what: str, instead: str) -> RefusedByDeepcompile:
    """For a name that must import (a client imports it before knowing whether it will use it)
    but cannot do its work here: raised when it is called or constructed, saying what to use."""
    return RefusedByDeepcompile(f"deepcompile does not implement {what}; {instead}")
