"""What a parallel model's rank > 0 runs: its part of the model, and the steps rank 0 sends it.

`distributed/` starts the ranks with `RankWorker` as a factory and never imports this module.
The messages, in the order rank 0 sends them:

    ("kv", num_pages, page_size)      an arena of num_pages pages of this rank's heads / layers
    ("step", copies, batch, twins)     page copies, then the forward of `batch` (and its twins)
    ("logits", hidden)                 tensor parallel: stage 0's vocabulary slices, gathered
    ("stop",)
"""

from __future__ import annotations

from typing import Any

import torch

from treeserve.distributed.groups import Placement
from treeserve.distributed.protocol import WorkerArgs


class RankWorker:
    """Rank `args.rank` > 0: its part of the model, and the messages rank 0 sends it."""

    def __init__(self, args: WorkerArgs) -> None:
        """Join the groups, then load this rank's part (a failure there is `load_error`, for rank 0)."""
        from treeserve.models.loader import load_model

        config = args.config
        torch.set_num_threads(args.threads)
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.config, self.device, self.runner = config, device, None
        tp, pp = config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size
        self.placement = Placement(args.rank, tp, pp).connect(
            args.host, args.port, device, config.parallel_config.parallel_timeout_s
        )
        self.load_error: str | None = None
        try:
            loaded = load_model(
                config.model,
                config.device_config.torch_dtype,
                device,
                config.load_config.quantization,
                config.load_config.quant_activations,
                tp_rank=self.placement.tp_rank,
                tp_size=tp,
                pp_rank=self.placement.pp_rank,
                pp_size=pp,
                max_positions=config.load_config.max_model_len,
            )
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
            self.load_error = f"{type(e).__name__}: {e}"
            return
        self.model, self.model_config = loaded.model, loaded.config
        if self.placement.tp is not None:
            self.model.attach(self.placement.tp)
        self.parts = {
            "weights": sum(t.numel() * t.element_size() for t in self.model.state_dict().values()),
            "kv_token_bytes": self._layout().token_bytes,
            "quantization": loaded.quantization,
        }

    def _layout(self) -> Any:
        from treeserve.kv.arena import KVLayout

        cfg = self.model_config
        return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.config.kv_torch_dtype)

    @torch.inference_mode()
    def handle(self, message: tuple) -> bool:
        """Run one message; False for "stop"."""
        from treeserve.engine.attention import BACKENDS
        from treeserve.engine.model_runner import ModelRunner
        from treeserve.kv.arena import KVArena, PageArena

        kind, cfg, placement = message[0], self.model_config, self.placement
        if kind == "kv":
            _, num_pages, page_size = message
            dtype = self.config.device_config.torch_dtype
            pages = PageArena(num_pages, self._layout().page_bytes(page_size), self.device)
            arena = KVArena(
                num_pages,
                cfg.num_layers,
                page_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                self.config.kv_torch_dtype,
                self.device,
                pages=pages,
            )
            stage = None if placement.pp is None else (placement.pp, placement.pp_rank, placement.pp_size, dtype)
            self.runner = ModelRunner(
                self.model,
                arena,
                self.device,
                cfg.attn_scale,
                BACKENDS[self.config.device_config.attention_backend](),
                stage=stage,
            )
        elif kind == "step":
            self.runner.mirror_step(*message[1:])
        elif kind == "logits" and placement.pp_rank == 0:  # stage 0 holds the LM head's shards
            self.model.compute_logits(message[1].to(self.device))
        return kind != "stop"
