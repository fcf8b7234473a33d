"""Integrations of autofit with training frameworks; each module imports its framework only when
imported itself (`autofit.integrations.transformers` for Hugging Face's Trainer)."""

__all__: list[str] = []
