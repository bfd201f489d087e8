"""Checkpoints that are complete or absent: the single-process commit protocol of a
checkpoint folder (:mod:`~ddp_eval.checkpointing.commit`), background saves, and the
distributed :class:`~ddp_eval.checkpointing.checkpoint.Checkpointer` around them.

May import: :mod:`ddp_eval.distributed`, :mod:`ddp_eval.config`, :mod:`ddp_eval.errors`,
:mod:`ddp_eval.sb_compat`; nothing from evaluation (:mod:`ddp_eval.state`,
:mod:`ddp_eval.stage`; checked by ``tests/test_layout.py``). Modules whose names
start with ``_`` are not public API.
"""
