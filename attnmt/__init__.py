"""attnmt: attention-based neural machine translation from the command line."""

__version__ = "0.1.0"

__all__ = ["Translator", "__version__"]


def __getattr__(name: str) -> object:
    """`from attnmt import Translator` imports torch only when asked (the CLI starts fast)."""
    if name == "Translator":
        from attnmt.decoding.translator import Translator

        return Translator
    raise AttributeError(f"module 'attnmt' has no attribute {name!r}")
