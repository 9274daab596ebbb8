from node.runtime.stage import (  # noqa: F401
    ComputeWorker, Context, QueueFull, RuntimeOptions, StageRuntime, cancel_all, max_batch_for,
    new_microbatch_rng, pin_torch_threads,
)
