"""What a sharded stage's batches do to the recipe's state, and how every rank's
record merges into what one process would hold: no collectives.

Owns: watching attributes and metric objects during a stage (probes for numbers,
tensors, arrays and empty lists; watches of lists, dicts, tensors and arrays),
fingerprints that check a record explains the state it describes, and the pure
merges in global batch order (:func:`~ddp_eval.state.bookkeeping.merge_stage`).

May import: :mod:`ddp_eval.errors`, :mod:`ddp_eval.sb_compat` and its own modules;
never :mod:`ddp_eval.dist`, :mod:`ddp_eval.stage` or :mod:`ddp_eval.checkpointing`
(checked by ``tests/test_layout.py``). Modules whose names start with ``_`` are not
public API.
"""
