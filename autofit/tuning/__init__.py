"""Autofit.tune: measured trials and the verdict."""
