"""Exceptions raised by ddp_eval.

Every message says what was expected, what was found and what to do.
"""


class DDPEvalError(RuntimeError):
    """Base class of every error ddp_eval raises."""


class ConfigError(DDPEvalError, ValueError):
    """An option in the ``ddp_eval:`` hparams section or a keyword is invalid."""


class RankFailedError(DDPEvalError):
    """Another rank raised an exception; raised on every rank that did not fail."""


class CollectiveTimeoutError(DDPEvalError):
    """Not every rank arrived at a synchronisation point within the timeout."""


class OutOfStepError(DDPEvalError):
    """Ranks reached different synchronisation points (they took different branches)."""


class BatchPlanError(DDPEvalError):
    """Ranks built different evaluation batches (a sampler that differs across ranks)."""


class VerificationError(DDPEvalError):
    """``verify: strict``: what on_stage_end would see differs from one process."""


class StateDivergenceError(DDPEvalError):
    """Scheduler or epoch-counter state differs across ranks after ``on_stage_end``."""


class CheckpointWriteError(DDPEvalError):
    """Writing a checkpoint failed on the writing rank; the previous one is intact."""

    @classmethod
    def naming(cls, rank: int, path, error: BaseException, what: str = "") -> "CheckpointWriteError":
        """The error for ``error``, raised on ``rank`` writing ``what`` of checkpoint ``path``."""
        return cls(f"ddp_eval: rank {rank} could not write {what}checkpoint {path}: "
                   f"{type(error).__name__}: {error}. The previous checkpoints are intact.")


class CheckpointLoadError(DDPEvalError):
    """Loading a chosen checkpoint failed; raised on every rank, naming the file."""

    @classmethod
    def naming(cls, rank: int, checkpoint, error: BaseException, recoverable=None, file=None
               ) -> "CheckpointLoadError":
        """The error for ``error``, raised on ``rank`` loading ``recoverable`` from ``file``."""
        what = f"recoverable '{recoverable}' from {file}" if file else f"checkpoint {checkpoint}"
        return cls(
            f"ddp_eval: rank {rank} could not load {what} (checkpoint "
            f"{checkpoint}): {type(error).__name__}: {error}. Expected a file that its "
            "recoverable's load hook accepts; move the checkpoint away to resume from the "
            "previous one, or fix the recoverable's definition."
        )


class StorageError(DDPEvalError):
    """The checkpoint storage lacks atomic rename or fsync and fallback is off."""
