"""Registers zinf's log alias with torch before torch parses ``TORCH_LOGS``.

Loaded by torch's backend autoload (entry point group ``torch.backends``) during ``import torch``,
which torch runs before validating ``TORCH_LOGS`` precisely so that extensions can register their
log names; without it ``TORCH_LOGS="+zinf"`` would be rejected. Torch 2.11 loads these entry
points only after it has parsed ``TORCH_LOGS``, so there the alias cannot be used from the environment
(``TORCH_LOGS="+zinf_compile"`` works on every version). Kept tiny and free of zinf imports, since it
runs on every ``import torch`` in this environment.
"""


def register() -> None:
    try:
        from torch._logging._internal import log_registry, register_log
    except ImportError:  # torch moved it: TORCH_LOGS="+zinf_compile" still works
        return
    if not log_registry.is_log("zinf"):
        register_log("zinf", ["zinf_compile", "zinf_runtime"])
