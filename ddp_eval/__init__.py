"""ddp_eval: exact, sharded evaluation and safe checkpoints for SpeechBrain under torchrun.

Public API
----------
DDPEvalMixin
    ``class MyBrain(DDPEvalMixin, sb.Brain)``: shards VALID/TEST, merges loss and metrics.
Checkpointer
    Drop-in ``speechbrain.utils.checkpoints.Checkpointer``: atomic, rank-0 writes,
    optionally non-blocking (``async_save``).
load_full_state_dict
    One process reads a sharded (FSDP) recoverable's DCP folder, or a plain file,
    as one full state dict (e.g. ``average_checkpoints(..., parameter_loader=...)``).
CheckpointFolder, inspect_checkpoint_dir
    The single-process commit protocol of a checkpoints folder; what resume accepts.
DDPEvalConfig
    The ``ddp_eval:`` hparams section.
shard_dataloader, ShardedBatchSampler, ShardedStreamLoader, shard_batches
    Sharding of evaluation batches (e.g. for a ready DataLoader) and of streams.
merge_metric_stats, find_metric_objects
    Pure merge of per-rank metric state; discovery of metric objects.
merge_attribute_states
    Pure merge of plain Brain attributes (lists, dicts, counters, accumulators).
ControlChannel
    Bounded O(N) control exchanges over any ``torch.distributed`` Store.
Errors
    DDPEvalError and its subclasses.
"""

from ddp_eval.checkpointing.checkpoint import Checkpointer
from ddp_eval.checkpointing.commit import CheckpointFolder, inspect_checkpoint_dir
from ddp_eval.config import DDPEvalConfig
from ddp_eval.distributed import ControlChannel, warn_shared_store_restarts
from ddp_eval.distributed.dcp import load_full_state_dict
from ddp_eval.errors import (
    BatchPlanError,
    CheckpointLoadError,
    CheckpointWriteError,
    CollectiveTimeoutError,
    ConfigError,
    DDPEvalError,
    OutOfStepError,
    RankFailedError,
    StateDivergenceError,
    StorageError,
    VerificationError,
)
from ddp_eval.mixin import DDPEvalMixin
from ddp_eval.stage.sharding import ShardedBatchSampler, ShardedStreamLoader, shard_batches, shard_dataloader
from ddp_eval.state.attribute_merge import merge_attribute_states
from ddp_eval.state.metric_merge import merge_metric_stats
from ddp_eval.state.metrics import find_metric_objects

__version__ = "0.9.25"

__all__ = [
    "DDPEvalMixin",
    "Checkpointer",
    "load_full_state_dict",
    "CheckpointFolder",
    "DDPEvalConfig",
    "ShardedBatchSampler",
    "ShardedStreamLoader",
    "shard_batches",
    "shard_dataloader",
    "merge_metric_stats",
    "find_metric_objects",
    "merge_attribute_states",
    "ControlChannel",
    "inspect_checkpoint_dir",
    "DDPEvalError",
    "ConfigError",
    "RankFailedError",
    "CollectiveTimeoutError",
    "OutOfStepError",
    "StateDivergenceError",
    "VerificationError",
    "BatchPlanError",
    "CheckpointWriteError",
    "CheckpointLoadError",
    "StorageError",
]

warn_shared_store_restarts()  # at import: before the recipe creates its process group
