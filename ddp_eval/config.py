"""The ``ddp_eval:`` section of a recipe's hparams YAML, validated at start-up.

Example
-------
>>> cfg = DDPEvalConfig.from_hparams({"ddp_eval": {"shard_test": False}})
>>> cfg.shard_valid, cfg.shard_test
(True, False)
>>> DDPEvalConfig.from_hparams({"ddp_eval": {"shard_tset": False}})
Traceback (most recent call last):
...
ddp_eval.errors.ConfigError: ddp_eval: unknown option 'shard_tset' in the 'ddp_eval:' hparams section; allowed options: attribute_memory_mb, attributes_exclude, attributes_include, check_consistency, collective_timeout, fsdp, merge, metrics_exclude, metrics_include, on_unmergeable_attribute, resume_eval, resume_eval_dir, resume_eval_every_s, shard_test, shard_valid, stream_split, verify
"""

import os
import pickle
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional

import yaml

from ddp_eval.errors import ConfigError
from ddp_eval.state.attribute_merge import REDUCTIONS

SECTION = "ddp_eval"
ENV_VAR = "DDP_EVAL"  # options over the section, for a YAML without one


@dataclass(frozen=True)
class DDPEvalConfig:
    """Options of :class:`ddp_eval.DDPEvalMixin`.

    Arguments
    ---------
    shard_valid : bool
        Shard the validation set across ranks (default True).
    shard_test : bool
        Shard the test set across ranks (default True).
    metrics_include : list of str, optional
        Names of Brain attributes holding metric objects to merge; default:
        every SpeechBrain metric object found on the Brain.
    metrics_exclude : list of str
        Brain attributes never merged (e.g. a metric you merge yourself).
    check_consistency : bool
        After every ``on_stage_end``, compare scheduler, epoch-counter and
        learning-rate state across ranks and raise on divergence (default
        False: costs one small exchange per stage).
    collective_timeout : float
        Seconds any ddp_eval wait may block before it raises, naming the
        ranks that did not arrive (default 600).
    attributes_include : list of str, optional
        Plain Brain attributes (lists, dicts, counters, accumulators) to merge
        after a sharded stage; default: every attribute that changed. Names
        with a dot are paths to state outside the Brain, merged with the same
        rules (e.g. ``hparams.aligner.align_dict``); they add to the Brain's
        attributes, which only names without a dot restrict.
    attributes_exclude : list of str
        Brain attributes never merged (they stay rank-local, without warning);
        also paths outside the Brain, and the global random generators
        (``torch.random``, ``random``, ``numpy.random``) whose draws in
        evaluation batches (DataLoader workers' too) are then not named.
    on_unmergeable_attribute : str
        What to do when an attribute changed during a sharded stage in a way
        that cannot be merged (e.g. replaced by a new object): ``"warn"``
        (default: log a warning naming it) or ``"error"``.
    attribute_memory_mb : float
        Memory per rank for the per-batch increments of float tensor
        attributes (default 64), which keep single-process order; beyond it,
        each rank sends one total per attribute (warned about once).
    resume_eval : bool
        Journal sharded VALID/TEST stages, so that one interrupted (preempted,
        killed, restarted by torchrun) resumes where it stopped when started
        again, with any number of ranks, exactly (default True). Needs a
        checkpointer or ``resume_eval_dir``; otherwise it is off.
    resume_eval_every_s : float
        Each rank journals its finished batches at most every that many
        seconds (default 60; 0: after every batch). A resumed stage evaluates
        again at most one interval of batches per rank.
    resume_eval_dir : str, optional
        Where journals live (default: ``.ddp_eval-journal`` in the
        checkpointer's folder). It should be visible to rank 0 (on every node,
        with several nodes); batches whose pieces it cannot read are evaluated again.
    stream_split : str
        How an ``IterableDataset`` VALID/TEST set is split: ``"batches"``
        (default: every rank reads the whole stream and evaluates its share of
        the batches; exact) or ``"by_dataset"`` (the dataset already yields a
        different part on each rank, e.g. ``wds.split_by_node``; faster, but
        batches differ from one process, see the README).
    verify : str
        Prove the conversion on the recipe's own data (:mod:`ddp_eval.stage._verify`):
        ``"off"`` (default), ``"first"`` (the first VALID and the first TEST
        stage: each rank also evaluates every batch as one process would and
        compares what ``on_stage_end`` sees; differences are warned about by
        path), ``"every"`` (every VALID/TEST stage) or ``"strict"`` (as
        ``first``, and any difference is an error on every rank). Costs about
        one more one-process evaluation of each verified stage.
    merge : dict
        ``{attribute: reduction}``: how an attribute merges where inference cannot
        know (``best_score: max``), one of ``max``, ``min``, ``sum``, ``union``,
        or a module-level function of every rank's value (``!name:``, as
        torchmetrics' ``dist_reduce_fx``; :mod:`ddp_eval.state._declared`); a
        rank whose value contradicts it is named. Names with a dot are paths, as in ``attributes_include``.
    fsdp : FSDPOptions, optional
        Shard the trainable modules with torch's FSDP (``fully_shard``) instead
        of wrapping them in DDP under ``torchrun``: ``fsdp: true`` (defaults) or
        a mapping of :class:`FSDPOptions` (default None: DDP, as SpeechBrain).
    """

    shard_valid: bool = True
    shard_test: bool = True
    metrics_include: Optional[List[str]] = None
    metrics_exclude: List[str] = field(default_factory=list)
    check_consistency: bool = False
    collective_timeout: float = 600.0
    attributes_include: Optional[List[str]] = None
    attributes_exclude: List[str] = field(default_factory=list)
    on_unmergeable_attribute: str = "warn"
    attribute_memory_mb: float = 64.0
    resume_eval: bool = True
    resume_eval_every_s: float = 60.0
    resume_eval_dir: Optional[str] = None
    stream_split: str = "batches"
    verify: str = "off"
    merge: Dict[str, Any] = field(default_factory=dict)
    fsdp: Optional["FSDPOptions"] = None

    @classmethod
    def from_hparams(cls, hparams: Optional[Mapping[str, Any]],
                     environ: Optional[Mapping[str, str]] = None) -> "DDPEvalConfig":
        """Builds the config from ``hparams["ddp_eval"]`` (absent: defaults), with the
        options of the ``DDP_EVAL`` environment variable over it (a YAML mapping, e.g.
        ``DDP_EVAL="{verify: first}"``: hyperpyyaml refuses ``--ddp_eval`` overrides
        on a YAML without a ``ddp_eval:`` section, as converted recipes have).

        Example
        -------
        >>> DDPEvalConfig.from_hparams({}, {"DDP_EVAL": "{verify: first}"}).verify
        'first'
        """
        section = (hparams or {}).get(SECTION) or {}
        if not isinstance(section, Mapping):
            raise ConfigError(
                f"ddp_eval: the '{SECTION}:' hparams entry must be a mapping of "
                f"options, got {type(section).__name__}: {section!r}"
            )
        text = (os.environ if environ is None else environ).get(ENV_VAR)
        if text:
            try:
                override = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"ddp_eval: {ENV_VAR} must be a YAML mapping of options, e.g. "
                                  f"\"{{verify: first}}\"; got {text!r} ({exc})") from exc
            if not isinstance(override, Mapping):
                raise ConfigError(f"ddp_eval: {ENV_VAR} must be a YAML mapping of options, e.g. "
                                  f"\"{{verify: first}}\"; got {text!r}")
            section = {**section, **override}
        allowed = sorted(f.name for f in fields(cls))
        for key in section:
            if key not in allowed:
                raise ConfigError(
                    f"ddp_eval: unknown option '{key}' in the '{SECTION}:' hparams "
                    f"section; allowed options: {', '.join(allowed)}"
                )
        section = dict(section)
        if section.get("verify") is False:  # YAML reads a bare `off` as false
            section["verify"] = "off"
        section["fsdp"] = FSDPOptions.from_section(section.get("fsdp"))
        cfg = cls(**section)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        for name in ("shard_valid", "shard_test", "check_consistency", "resume_eval"):
            _expect(name, getattr(self, name), isinstance(getattr(self, name), bool), "true or false")
        for name in ("metrics_include", "metrics_exclude", "attributes_include", "attributes_exclude"):
            value = getattr(self, name)
            ok = (value is None and name.endswith("_include")) or (
                isinstance(value, list) and all(isinstance(v, str) for v in value)
            )
            _expect(name, value, ok, "a list of Brain attribute names")
        timeout = self.collective_timeout
        ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        _expect("collective_timeout", timeout, ok, "a number of seconds > 0")
        budget = self.attribute_memory_mb
        ok = isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget >= 0
        _expect("attribute_memory_mb", budget, ok, "a number of megabytes >= 0")
        every = self.resume_eval_every_s
        ok = isinstance(every, (int, float)) and not isinstance(every, bool) and every >= 0
        _expect("resume_eval_every_s", every, ok, "a number of seconds >= 0")
        folder = self.resume_eval_dir
        _expect("resume_eval_dir", folder, folder is None or isinstance(folder, str), "a folder path or null")
        check_choice("on_unmergeable_attribute", self.on_unmergeable_attribute, ("warn", "error"))
        check_choice("stream_split", self.stream_split, ("batches", "by_dataset"))
        check_choice("verify", self.verify, ("off", "first", "every", "strict"))
        _expect("merge", self.merge, isinstance(self.merge, Mapping) and all(isinstance(k, str) for k in self.merge),
                "a mapping of attribute names to reductions")
        for path, reduction in self.merge.items():
            if callable(reduction):  # the recipe's own function: sent to every rank by reference
                try:
                    pickle.dumps(reduction)
                except Exception as exc:
                    raise ConfigError(f"ddp_eval: merge: {path}: expected one of {list(REDUCTIONS)} or a module-level "
                                      f"function (it travels by reference), got {reduction!r} ({type(exc).__name__}); "
                                      "define it at the top level of a module and name it with !name: in the YAML"
                                      ) from exc
                continue
            check_choice(f"merge: {path}", reduction, REDUCTIONS)


MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")
DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class FSDPOptions:
    """The ``fsdp:`` key of the ``ddp_eval:`` section (torch's ``fully_shard`` arguments).

    Arguments
    ---------
    shard_modules : list of str
        Class names of submodules sharded on their own (e.g. ``[TransformerEncoderLayer]``,
        as ``transformer_layer_cls`` in other trainers); the rest of each trainable
        module is sharded with the module itself (default: none on their own).
    reshard_after_forward : bool
        Free the gathered parameters after each training forward (default True:
        least memory; False keeps them until the backward, as ZeRO-2).
    mixed_precision : dict, optional
        ``param_dtype``, ``reduce_dtype``, ``output_dtype``: names of torch dtypes
        (``bfloat16``, ``float16``, ``float32``), as ``MixedPrecisionPolicy``.
    cpu_offload : bool
        Keep the sharded parameters, gradients and optimizer state in CPU memory
        (``CPUOffloadPolicy``; default False).

    Example
    -------
    >>> FSDPOptions.from_section(True)
    FSDPOptions(shard_modules=(), reshard_after_forward=True, mixed_precision=None, cpu_offload=False)
    >>> FSDPOptions.from_section({"shard_modules": ["Linear"]}).shard_modules
    ('Linear',)
    >>> FSDPOptions.from_section(None) is None
    True
    """

    shard_modules: tuple = ()
    reshard_after_forward: bool = True
    mixed_precision: Optional[dict] = None
    cpu_offload: bool = False

    @classmethod
    def from_section(cls, value: Any) -> Optional["FSDPOptions"]:
        """``fsdp: null|false`` (off), ``true`` (defaults) or a mapping of options."""
        if value is None or value is False or isinstance(value, cls):
            return value or None
        if value is True:
            value = {}
        _expect("fsdp", value, isinstance(value, Mapping), "true, false or a mapping of FSDP options")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ConfigError(f"ddp_eval: unknown option(s) {unknown} under 'fsdp:'; allowed options: "
                              f"{', '.join(allowed)}")
        options = dict(value)
        shard = options.get("shard_modules", [])
        _expect("fsdp.shard_modules", shard, isinstance(shard, (list, tuple)) and all(
            isinstance(n, str) for n in shard), "a list of module class names")
        options["shard_modules"] = tuple(shard)
        for name in ("reshard_after_forward", "cpu_offload"):
            if name in options:
                _expect(f"fsdp.{name}", options[name], isinstance(options[name], bool), "true or false")
        precision = options.get("mixed_precision")
        if precision is not None:
            _expect("fsdp.mixed_precision", precision, isinstance(precision, Mapping) and set(precision) <= set(
                MIXED_PRECISION_KEYS) and all(v in DTYPES for v in precision.values()),
                f"a mapping of {', '.join(MIXED_PRECISION_KEYS)} to one of {', '.join(DTYPES)}")
            options["mixed_precision"] = dict(precision)
        return cls(**options)


def _expect(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(
            f"ddp_eval: option '{name}' expects {allowed}, got "
            f"{type(value).__name__} {value!r}"
        )


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """Validates an option string against a fixed set.

    Example
    -------
    >>> check_choice("storage", "shared", ("shared", "node_local"))
    'shared'
    """
    if value not in choices:
        raise ConfigError(
            f"ddp_eval: option '{name}' expects one of {list(choices)}, got {value!r}"
        )
    return value
