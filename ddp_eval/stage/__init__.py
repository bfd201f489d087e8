"""One sharded VALID/TEST stage on a rank: the batch plan and its dealing
(:mod:`~ddp_eval.stage.sharding`), the stage's collectives around the state's
record and merge (:class:`~ddp_eval.stage._sharded.ShardedStage`), what the
stage-end exchange tells every rank, per-batch files and other effects, the
evaluation journal and its resume, and ``verify``.

May import: :mod:`ddp_eval.state`, :mod:`ddp_eval.checkpointing` (the journal
writes its pieces atomically), :mod:`ddp_eval.distributed`, :mod:`ddp_eval.config`,
:mod:`ddp_eval.errors`, :mod:`ddp_eval.sb_compat`; never the mixin (checked by
``tests/test_layout.py``). Modules whose names start with ``_`` are not public API.
"""

from ddp_eval.stage._consistency import check_states_agree, state_summaries
from ddp_eval.stage._journal import JOURNAL_DIRNAME, describe_journals
from ddp_eval.stage._loop import global_train_loss
from ddp_eval.stage._sharded import ShardedStage

__all__ = ["ShardedStage", "check_states_agree", "state_summaries", "JOURNAL_DIRNAME", "describe_journals",
           "global_train_loss"]
