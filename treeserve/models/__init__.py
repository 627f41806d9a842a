"""Model definitions (Llama family) and loaders (safetensors checkpoints, tokenizers, chat templates)."""
