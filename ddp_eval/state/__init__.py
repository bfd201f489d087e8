"""What a sharded stage's batches do to the recipe's state, and how every rank's
record merges into what one process would hold: no collectives.

Owns: watching attributes and metric objects during a stage (probes for numbers,
tensors, arrays and empty lists; watches of lists, dicts, tensors and arrays),
fingerprints that check a record explains the state it describes, and the pure
merges in global batch order (:func:`~ddp_eval.state.bookkeeping.merge_stage`).

May import: :mod:`ddp_eval.errors`, :mod:`ddp_eval.sb_compat` and its own modules;
never :mod:`ddp_eval.distributed`, :mod:`ddp_eval.stage` or :mod:`ddp_eval.checkpointing`
(checked by ``tests/test_layout.py``). Modules whose names start with ``_`` are not
public API.
"""

from ddp_eval.state import _standins  # noqa: F401 - stand-ins pass as plain values to yaml and torch.load
from ddp_eval.state._attributes import AttributeTracker
from ddp_eval.state._explain import Fingerprint, compared_captured_state
from ddp_eval.state._order import as_chunks, growth_since, in_global_order
from ddp_eval.state._outside import changed_outside, outside_markers
from ddp_eval.state._values import is_array, is_number, numpy, recipe_names

__all__ = ["AttributeTracker", "Fingerprint", "compared_captured_state", "as_chunks", "growth_since",
           "in_global_order", "changed_outside", "outside_markers", "is_array", "is_number", "numpy",
           "recipe_names"]
