"""Training and evaluation scripts of the built-in arithmetic world (issue 3)."""
