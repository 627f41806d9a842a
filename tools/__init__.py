"""Developer tools (training scripts); never imported by the runtime."""
