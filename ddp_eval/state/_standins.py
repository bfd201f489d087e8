"""Stand-ins pass as the values they stand for outside ddp_eval.

During a batch a watched value may be a stand-in: a probe (a subclass of
``int``, ``float``, ``str``, ``bytes``, ``torch.Tensor`` or ``numpy.ndarray``, or
an empty ``list``) or a recording copy (a subclass of the container). Each
pickles, copies and deep-copies as the plain value it stands for (their
``__reduce__``); here the two serialisers that do not go through
``__reduce__`` learn the same: PyYAML writes a stand-in as the plain value, and
``torch.load(weights_only=True)`` accepts :func:`~ddp_eval.state._values.as_builtin`,
the builtin a stand-in saves as. ``type(v)`` and ``isinstance(v, Probe)`` are
what stays visible (docs/exactness.md).

Example
-------
>>> import io, torch, yaml
>>> from ddp_eval.state._numbers import probe
>>> n = probe(3)
>>> yaml.safe_dump({"n": n}), json.dumps(n)
('n: 3\\n', '3')
>>> buffer = io.BytesIO(); torch.save({"n": n}, buffer); _ = buffer.seek(0)
>>> loaded = torch.load(buffer, weights_only=True)["n"]
>>> loaded, type(loaded).__name__
(3, 'int')
"""

import copy
import json  # noqa: F401 - the example
from typing import Any

import torch
import yaml

from ddp_eval.state._numbers import _Probe
from ddp_eval.state._rebuilt import ArrayProbe, TensorProbe, _EmptyProbe
from ddp_eval.state._recording import _Recording
from ddp_eval.state._values import as_builtin

STAND_INS = tuple(cls for cls in (_Probe, _EmptyProbe, _Recording, TensorProbe, ArrayProbe) if cls is not None)


def _represent_plain(dumper: Any, data: Any) -> Any:
    return dumper.represent_data(copy.copy(data))  # a stand-in's copy is the plain value


for _representer in (yaml.representer.SafeRepresenter, yaml.representer.Representer):
    for _cls in STAND_INS:
        _representer.add_multi_representer(_cls, _represent_plain)
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([as_builtin])
