"""The stage runtime: one pipeline stage trained asynchronously from the frames that reach it
(``StageRuntime``, the coordinator, and its parts: see ``node/runtime/stage.py``)."""

from node.runtime.options import Context, RuntimeOptions, max_batch_for, new_microbatch_rng
from node.runtime.stage import StageRuntime
from node.runtime.worker import ComputeWorker, QueueFull, cancel_all, pin_torch_threads

__all__ = [
    "ComputeWorker", "Context", "QueueFull", "RuntimeOptions", "StageRuntime", "cancel_all", "max_batch_for",
    "new_microbatch_rng", "pin_torch_threads",
]
