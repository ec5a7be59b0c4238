"""Batched serving: continuous batching over slots with a paged KV cache (docs/design/serving.md).

- `ServingEngine` (engine.py): the host API, `submit` / `step` / `stream` / `cancel` / `run`.
- `serve_call` (step.py): the pure jit'd device call underneath, for other JAX serving stacks
  (docs/embedding.md).
- `ServingOptions` (state.py): the batching mechanisms, each a switch: budgeted verification,
  packed ragged verification, device-resident steps, two-level verification.
"""

from specjax.serving.engine import QueueFullError, RequestResult, ServingEngine
from specjax.serving.state import ServingOptions

__all__ = ["ServingEngine", "ServingOptions", "RequestResult", "QueueFullError"]
