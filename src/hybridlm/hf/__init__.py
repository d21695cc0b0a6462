"""Hugging Face `transformers` integration: converters from transformers models and checkpoint directories
(`convert*.py`, `directory.py`, `native.py`), hybridlm models as transformers models (`modeling.py`), and the
Auto-class registration hook that `import hybridlm` installs (`auto.py`). transformers is an optional dependency:
nothing is imported here until asked for, so `import hybridlm` stays fast."""

__all__ = ["from_transformers", "to_state_dict", "config_from_transformers", "CONVERTERS"]


def __getattr__(name: str):
    if name in __all__:
        from . import convert
        return getattr(convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
