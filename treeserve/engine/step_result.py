"""The step's contract, device to host: what one step's device work returns, and how it fails.

Data only. A step that raised fails its own requests (`StepFailed`); a step that read the
samples of a failed step did not run (`PreviousStepFailed`) and is rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeserve.engine.sampler import TokenLogprobs


@dataclass
class StepResult:
    tokens: torch.Tensor | None = None  # [S] sampled ids on the device: the next step's pending inputs
    host_tokens: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None  # after the step's last device-to-host copy (CUDA)
    logprobs: TokenLogprobs | None = None
    scores: torch.Tensor | None = None  # [R, K] float32, host (filled when `copied` has passed)
    states: torch.Tensor | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed: int = 0  # tokens run through the model (a twin's are not)

    def wait(self) -> None:
        """Block until the step's device-to-host copies are done (then its device tensors are
        safe to read from any stream)."""
        if self.copied is not None:
            self.copied.synchronize()

    def sampled(self) -> list[int]:
        self.wait()
        return self.host_tokens.tolist()


class StepFailed(RuntimeError):
    """A step raised while running its batch: its requests (`request_ids`) were aborted, no other."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        what = f"{type(cause).__name__}: {cause}"
        super().__init__(f"the engine step serving {len(request_ids)} request(s) failed: {what}")
        self.request_ids = request_ids
        self.cause = cause


class PreviousStepFailed(RuntimeError):
    """This step read tokens of a step that failed: it did not run."""
