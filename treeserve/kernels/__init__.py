"""Compute kernels, one package per family: `cpu` (C, built at first use) and `triton` (GPUs, and
CPU tensors under TRITON_INTERPRET=1). Nothing here knows about models, requests or pages'
owners: kernels take tensors and shapes. `layers/` and the engine's attention backends pick
among them; PyTorch is the reference each is tested against."""
