"""stages/: pure PyTorch — the model and its stage split, the run manifest, the Subspace codec,
AsyncMesh maths, optimizers, architecture warm-up, sharpness and data. No I/O beyond reading files.

This is what the other packages may use; everything else is internal to stages/."""

from stages.asyncmesh import (  # noqa: F401
    LookaheadForward, PartitionSchedule, StageWeights, StalenessCorrection, StepClock, StepPolicy,
    apply_average_delta, first_moments, snapshot,
)
from stages.avg_blend import BlendedDelta  # noqa: F401
from stages.data import (  # noqa: F401
    Batches, DataError, load_corpus, val_batches,
)
from stages.manifest import (  # noqa: F401
    Manifest, ManifestError, SentinelConfig, consensus_dict, consensus_hash, diff_manifests, even_layout, load_manifest,
    manifest_from_dict, manifest_hash, manifest_toml,
)
from stages.model import (  # noqa: F401
    Stage, Transformer, build_model, build_stage, count_parameters, lm_loss, rope_tables, split_model,
)
from stages.morph import (  # noqa: F401
    MORPH_KINDS, MorphError, MorphMaster, boundary_secret, fold_input, fold_output, morph_chain, morph_width,
    private_init, transform_from_seed,
)
from stages.optim import (  # noqa: F401
    build_optimizer, hidden_matrix_names, lr_at, set_lr,
)
from stages.sharpness import (  # noqa: F401
    SharpnessTracker, adam_preconditioner, eos_bound,
)
from stages.robust_avg import (  # noqa: F401
    AveragingLayout, RoundOutcome, butterfly, chunk_elements, judge_contributions, refused_reducers, robust_mean,
)
from stages.state_check import NORM_RATIO_TOLERANCE, STATE_TOLERANCE, agreeing, norm_ratio, state_distance
from stages.subspace import (  # noqa: F401
    SubspaceCodec, wire_bytes_per_token,
)
from stages.warmup import (  # noqa: F401
    ArchWarmup, default_warmup_schedule,
)

__all__ = [
    "AveragingLayout",
    "RoundOutcome",
    "butterfly",
    "chunk_elements",
    "judge_contributions",
    "refused_reducers",
    "robust_mean",
    "STATE_TOLERANCE",
    "NORM_RATIO_TOLERANCE",
    "agreeing",
    "norm_ratio",
    "state_distance",
    "ArchWarmup",
    "Batches",
    "BlendedDelta",
    "DataError",
    "LookaheadForward",
    "Manifest",
    "ManifestError",
    "MORPH_KINDS",
    "MorphError",
    "MorphMaster",
    "PartitionSchedule",
    "SentinelConfig",
    "SharpnessTracker",
    "Stage",
    "StageWeights",
    "StalenessCorrection",
    "StepClock",
    "StepPolicy",
    "SubspaceCodec",
    "Transformer",
    "adam_preconditioner",
    "apply_average_delta",
    "boundary_secret",
    "build_model",
    "build_optimizer",
    "build_stage",
    "consensus_dict",
    "consensus_hash",
    "count_parameters",
    "default_warmup_schedule",
    "diff_manifests",
    "eos_bound",
    "even_layout",
    "first_moments",
    "fold_input",
    "fold_output",
    "hidden_matrix_names",
    "lm_loss",
    "load_corpus",
    "load_manifest",
    "lr_at",
    "manifest_from_dict",
    "manifest_hash",
    "manifest_toml",
    "morph_chain",
    "morph_width",
    "private_init",
    "rope_tables",
    "set_lr",
    "snapshot",
    "split_model",
    "transform_from_seed",
    "val_batches",
    "wire_bytes_per_token",
]
