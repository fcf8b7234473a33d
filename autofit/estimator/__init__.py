"""Predicting a plan's peak without a GPU, and choosing where a run starts."""
