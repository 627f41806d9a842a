"""Evaluation: datasets, graders and metrics. Nothing here imports the engine."""
