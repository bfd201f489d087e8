"""Recipes written as SpeechBrain's own write their evaluation (issue 20), each
run by plain SpeechBrain in one process and converted with the mixin on every
rank, returning what ``on_stage_end`` saw.

* ``last_values``: HiFi-GAN / Tacotron 2: ``self.last_batch``, ``self.last_loss_stats[stage]``
  (checkpoint meta with ``min_keys=["loss"]``), ``self.last_attn``, a number set every batch;
  with counters in a ``defaultdict(int)`` and a ``Counter``.
* ``containers``: the k2 CTC recipe's ``defaultdict(ErrorRateStats)`` per decoding method,
  a plain dict of ErrorRateStats filled lazily, ``BLEUStats``, a DWER-like MetricStats
  subclass nesting two ErrorRateStats, a MetricStats on a local closure (UrbanSound8k);
  ErrorRateStats held deeper: in a dict of stages, in an object of the recipe's own and
  its dict, and in ``hparams`` (``!new:``).
* ``arrays``: ESC50 / UrbanSound8k confusion matrices ``np.zeros(..., dtype=int)`` ``+=``,
  and a float array.
* ``loaders``: BEST-RQ's VALID ``SaveableDataLoader`` and a ``LoopedLoader`` for TEST,
  built by the recipe and passed to ``fit``/``evaluate``; also under ``--debug``.
* ``files``: SLURP's ``predictions.jsonl`` appended every TEST batch through
  ``self.stage_output``; an EDER-like file appended without it; BEST-RQ's accuracy
  appended under ``if if_main_process():``.
* ``modules``: InputNormalization called through hparams, not in ``modules`` (six recipes).
* ``outside_reads``: a counter kept in an object of ``hparams`` (not listed in
  ``attributes_include``), read by every batch to choose what it appends to a Brain list:
  the list is named with the outside state.
* ``held_outside``: Brain lists a closure, a ``functools.partial``'s argument, a dict a
  closure holds, a global tuple, a global list and a dict of ``hparams`` also hold,
  appended to through them, and reads through an object of the recipe's own only a
  closure holds and through ``hparams``' dict, whose lengths steer appends (exact in
  one process; named on ranks).
* ``ordinary_code`` (issue 26): what ordinary Python and PyTorch code does outside the
  patterns above: a pre-sized list changed in place (``hist[label] += 1``), a
  MetricStats subclass of the recipe's own with a dict of lists per speaker and a
  BLEUStats-like nested list (``targets[0].extend``), values rebuilt from their previous
  one (``x = x + y``, ``torch.cat``, NumPy ``a = a + b``, ``ids = ids + [utt]``), and an
  attribute set to None in ``on_stage_start`` and assigned every batch.
* ``idioms`` (issue 32): counters in a dataclass and a ``SimpleNamespace``, a set grown
  with ``|=``, ``d[k] = d.get(k, 0) + 1``, ``setdefault(k, []).append``, a transcript grown
  with ``+=``, a tensor accumulated through ``.data``, a ``MetricStats`` subclass with a
  float field created lazily in a ``defaultdict``, a best score declared
  ``merge: max``, and (issue 37) one list held by two attributes, a dict's entry and
  ``hparams``, grown through each, and a prediction read back from the dict its batch put
  it in: exact.
* ``unmergeable_code`` (issue 32): a list sorted after each append, a ``deque(maxlen=5)``
  of recent ids, a count read from accumulated state (``len(self.scores)``), and (issue
  37) metric objects whose lists are sorted and cut, inserted into, trimmed, or appended
  after a read of their length: named.
  A count three subscripts down (``self.per_stage[stage]["spk"]["n"] += n``), not
  watched one by one, set on several ranks, and what its reads steered: named. A
  count beside a metric object in one dict (``{"err": ErrorRateStats(), "n": 0}``):
  the metric object exact, the dict named.
* ``steps``: ``self.step``, SpeechBrain's count of the stage's batches, read by each
  batch (kept, and steering which batches keep a sample id) and by TEST's
  ``on_stage_end``, where ``evaluate`` leaves the count; ``loaders`` reads it too.
* ``random_draws``: masks and noise drawn in evaluation from torch's, Python's and
  NumPy's global generators (as wav2vec2's and BEST-RQ's losses): named;
  ``seeded_draws``: drawn from a generator seeded by the batch's ids, and from torch's
  seeded by ``self.step`` inside ``fork_rng``: exact.
* ``own_average``: a recipe's own ``update_average`` without ``super()``, averaging a
  dict of losses (``OwnAverageBrain``).
* ``c_reads`` (issue 37): a running summary of an accumulator of the recipe's own,
  written per batch by ``json.dumps`` of what its method hands back, by a helper given
  it with a second parameter (also ahead of a spread tuple), by ``json.dumps`` held in
  a dict of ``hparams``, and of what a function of the recipe's ``hparams`` hold hands back:
  ``json.dumps`` reads its numbers in C, on a rank its own batches' only. The
  accumulator merges exactly; the summaries are named.

VALID: 23 utterances at batch 3 (8 batches), 2 epochs; TEST: 4 at batch 2 (2 batches:
at 3 ranks, rank 2 evaluates no TEST batch).
"""

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import logging
import os
import pathlib
import random
import sys
import types
import zlib

import numpy as np
import speechbrain as sb
import torch
from speechbrain.augment.time_domain import SpeedPerturb
from speechbrain.dataio.batch import PaddedBatch
from speechbrain.dataio.dataloader import LoopedLoader, SaveableDataLoader
from speechbrain.processing.features import InputNormalization
from speechbrain.utils.distributed import MainProcessContext, if_main_process
from speechbrain.utils.metric_stats import ErrorRateStats, MetricStats
from torch.utils.data import DataLoader

import ddp_eval
from tests import toy
from tests.mp_harness import ddp_eval_messages

PATTERNS = ("last_values", "containers", "arrays", "loaders", "files", "modules", "ordinary_code", "idioms",
            "unmergeable_code", "training_only", "outside_reads", "held_outside", "c_reads", "steps", "random_draws",
            "seeded_draws", "own_average")


def bleu_stats():
    """SpeechBrain's BLEUStats. In 1.1 its package imports flair, which the recipes
    using BLEU do not need: the module is loaded from its file."""
    try:
        from speechbrain.utils.bleu import BLEUStats
        return BLEUStats
    except ImportError:
        name = "speechbrain.integrations.nlp.bleu"
        path = pathlib.Path(sb.__file__).parent / "integrations" / "nlp" / "bleu.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
        spec.loader.exec_module(module)
        return module.BLEUStats


class KeepsHardest(MetricStats):
    """A recipe's own metric object that keeps its three hardest utterances: its
    append sorts both lists by score and cuts them (issue 37)."""

    def __init__(self):
        super().__init__(metric=lambda losses: losses)

    def append(self, ids, losses):
        super().append(ids, losses)
        order = sorted(range(len(self.scores)), key=lambda i: -float(self.scores[i]))[:3]
        self.ids, self.scores = [self.ids[i] for i in order], [self.scores[i] for i in order]


class NewestFirst(MetricStats):
    """A metric object that puts each new utterance first (``insert(0, ...)``)."""

    def __init__(self):
        super().__init__(metric=lambda losses: losses)

    def append(self, ids, losses):
        for i, score in zip(ids, self.metric(losses)):
            self.ids.insert(0, i)
            self.scores.insert(0, score)


class DWERLike(MetricStats):
    """Shaped as focalcodec's DWER: a MetricStats that does not call
    MetricStats.__init__, holds a model, and nests two ErrorRateStats."""

    def __init__(self):
        self.sample_rate = 16000
        self.model = torch.nn.Linear(2, 2)  # its Whisper model, in focalcodec
        self.wer_computer = ErrorRateStats()
        self.cer_computer = ErrorRateStats(split_tokens=True)

    def append(self, ids, hyp, ref):
        self.wer_computer.append(ids, hyp, ref)
        self.cer_computer.append(ids, hyp, ref)

    def summarize(self, field=None):
        summary = self.wer_computer.summarize()
        summary["CER"] = self.cer_computer.summarize("error_rate")
        return summary if field is None else summary[field]


class SpeakerStats(MetricStats):
    """A recipe's own MetricStats: per-speaker scores in a dict of lists, and
    targets as BLEUStats keeps them, one list per reference set."""

    def __init__(self):
        super().__init__(metric=None)

    def clear(self):
        super().clear()
        self.per_spk, self.predicts, self.targets = {}, [], [[]]

    def append(self, ids, predicts, targets, speakers):
        self.ids.extend(ids)
        self.predicts.extend(predicts)
        self.targets[0].extend(targets)
        for spk, p, t in zip(speakers, predicts, targets):
            self.per_spk.setdefault(spk, []).append(float(p == t))

    def summarize(self, field=None):
        accuracy = sum(p == t for p, t in zip(self.predicts, self.targets[0])) / max(len(self.predicts), 1)
        self.summary = {"accuracy": accuracy, "per_spk": {s: sum(v) / len(v) for s, v in self.per_spk.items()}}
        return self.summary if field is None else self.summary[field]


@dataclasses.dataclass
class Tally:
    """Counters a recipe keeps in a dataclass of its own."""

    correct: int = 0
    total: float = 0.0


class Report:
    """An object of the recipe's own that a closure holds, outside the Brain."""

    def __init__(self, ids):
        self.ids = ids


class Trackers:
    """Metric objects in an object of the recipe's own, one in a dict of its own."""

    def __init__(self):
        self.wer, self.per_label = ErrorRateStats(), {"all": ErrorRateStats()}


PAIR, HELD = None, None  # bound by the held_outside pattern's on_stage_start


def _append_to(items, item):
    """Appends ``item`` to ``items`` (held by a ``functools.partial``)."""
    items.append(item)


class ClassStats(MetricStats):
    """A recipe's own MetricStats, made per class during the stage, with number fields."""

    def __init__(self):
        super().__init__(metric=None)
        self.total, self.n = 0.0, 0

    def add(self, score):
        self.total += score  # cancelling floats: only batch order gives one process's bits
        self.n += 1


class PatternBrain(toy.ToyBrain):
    """The toy model and loss; each pattern's bookkeeping on top. ``stage_output``
    is the identity here, as a plain SpeechBrain recipe would open the path itself."""

    pattern = None
    interrupt_after = None  # TEST batches this process evaluates before a stand-in preemption

    def stage_output(self, path):
        return path

    def compute_forward(self, batch, stage):
        x, lens = batch.x
        if self.pattern == "modules":  # through hparams, not in modules, as EmoDia
            # SpeechBrain 1.0.3's InputNormalization all-reduces every batch's statistics
            # with ReduceOp.AVG, which gloo lacks: on CPU, TRAIN keeps them local, as 1.1 does.
            # TEST calls it in eval mode, as the warning about VALID advises: its statistics, learnt
            # on each rank's own TRAIN and VALID batches, still differ across ranks (named too).
            self.hparams.input_norm.train(stage != sb.Stage.TEST)
            with MainProcessContext() if stage == sb.Stage.TRAIN else contextlib.nullcontext():
                x = self.hparams.input_norm(x, lens)
        if self.pattern == "training_only" and stage == sb.Stage.TRAIN:  # TIMIT seq2seq's speed_perturb
            with torch.random.fork_rng():  # the ranks' draws differ, as their batches do
                torch.manual_seed(zlib.crc32(" ".join(batch.id).encode()))
                self.hparams.speed_perturb(x[..., 0].contiguous())  # the output unused: its state is what counts
        mask = (torch.arange(x.shape[1])[None, :] < (lens * x.shape[1]).round()[:, None]).float()
        return self.modules.model((x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))

    def on_fit_start(self):
        super().on_fit_start()
        self.last_epoch, self.last_batch, self.last_loss_stats = 0, None, {}  # as HiFi-GAN

    def compute_objectives(self, logits, batch, stage):
        labels = batch.label.data[:, 0]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if stage != sb.Stage.TRAIN:
            if stage == sb.Stage.TEST and self.interrupt_after is not None:
                if self.interrupt_after == 0:
                    raise toy.Interrupted("preempted during TEST")
                self.interrupt_after -= 1
            self.seen.ids.extend(batch.id)
            getattr(self, f"_batch_{self.pattern}")(logits, labels, loss, batch, stage)
        return loss

    def on_stage_start(self, stage, epoch=None):
        if stage != sb.Stage.TRAIN:
            getattr(self, f"_start_{self.pattern}")(stage)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        record = {"stage": stage.name, "loss": stage_loss, "epoch": epoch}
        if isinstance(stage_loss, dict):  # own_average: the total is what the checkpoint keeps
            stage_loss = stage_loss["loss"]
        if stage != sb.Stage.TRAIN:
            record.update(getattr(self, f"_end_{self.pattern}")(stage, stage_loss, epoch))
        if stage == sb.Stage.VALID:
            meta = {"loss": stage_loss, "epoch": epoch}
            if self.pattern == "last_values":  # HiFi-GAN: the last batch's loss stats become the meta
                meta = {**self.last_loss_stats[sb.Stage.VALID], "epoch": epoch}
            self.checkpointer.save_and_keep_only(meta=meta, min_keys=["loss"])
        self.log.append(record)

    # -- last_values ---------------------------------------------------------------

    def _start_last_values(self, stage):
        self.n_batches, self.per_class = 0, collections.defaultdict(int)
        self.per_label = collections.Counter()

    def _batch_last_values(self, logits, labels, loss, batch, stage):
        self.last_batch = (batch.x.data.detach().clone(), list(batch.id))
        self.last_loss_stats[stage] = {"loss": float(loss), "size": len(batch.id)}
        self.last_attn = logits.detach().clone()
        self.last_loss = loss.item()
        self.n_batches += 1
        for label in labels.tolist():
            self.per_class[label] += 1
            self.per_label[f"c{label}"] += 2

    def _end_last_values(self, stage, stage_loss, epoch):
        return {"last_ids": self.last_batch[1], "last_x": self.last_batch[0].tolist(),
                "last_attn": self.last_attn.tolist(), "last_loss": self.last_loss,
                "stats": dict(self.last_loss_stats), "n_batches": self.n_batches,
                "per_class": list(self.per_class.items()), "per_label": list(self.per_label.items())}

    # -- containers ----------------------------------------------------------------

    def _start_containers(self, stage):
        self.wer_metrics = collections.defaultdict(functools.partial(ErrorRateStats))
        self.cer_metrics = collections.defaultdict(functools.partial(ErrorRateStats, split_tokens=True))
        self.per_group = {}
        self.bleu = bleu_stats()()
        self.dwer = DWERLike()

        def accuracy_value(predict, target, lengths):  # a closure, as UrbanSound8k's
            return (predict.argmax(-1) == target).float()

        self.acc_metric = MetricStats(metric=accuracy_value, n_jobs=1)
        self.per_stage_metrics = {stage.name: {"wer": ErrorRateStats()}}  # two levels down
        self.trackers = Trackers()
        self.hparams.wer_stats.clear()  # `wer_stats: !new:...ErrorRateStats` in the YAML

    def _batch_containers(self, logits, labels, loss, batch, stage):
        preds = logits.argmax(-1)
        hyps = [[f"w{int(p)}", "a"] for p in preds]
        refs = [[f"w{int(t)}", "a", "b"][: 2 + int(t) % 2] for t in labels]
        for method in ("1best", "rescored"):  # the k2 recipe's decoding methods
            self.wer_metrics[method].append(batch.id, hyps, refs)
            self.cer_metrics[method].append(batch.id, hyps, refs)
        for utt, hyp, ref, label in zip(batch.id, hyps, refs, labels.tolist()):
            group = f"g{label}"
            if group not in self.per_group:
                self.per_group[group] = ErrorRateStats()
            self.per_group[group].append([utt], [hyp], [ref])
        self.bleu.append(batch.id, [" ".join(h) for h in hyps], [[" ".join(r) for r in refs]])
        self.dwer.append(batch.id, hyps, refs)
        self.acc_metric.append(batch.id, predict=logits.detach(), target=labels, lengths=None)
        for metric in (self.per_stage_metrics[stage.name]["wer"], self.trackers.wer, self.trackers.per_label["all"],
                       self.hparams.wer_stats):
            metric.append(batch.id, hyps, refs)

    def _end_containers(self, stage, stage_loss, epoch):
        text = io.StringIO()
        self.wer_metrics["1best"].write_stats(text)
        return {"methods": list(self.wer_metrics),
                "wer": [m.summarize("error_rate") for m in self.wer_metrics.values()],
                "cer": [m.summarize("error_rate") for m in self.cer_metrics.values()], "wer_stats": text.getvalue(),
                "groups": {g: (m.summarize("error_rate"), list(m.ids)) for g, m in self.per_group.items()},
                "group_order": list(self.per_group), "bleu": self.bleu.summarize("BLEU"),
                "bleu_targets": self.bleu.targets, "dwer": self.dwer.summarize(),
                "accuracy": self.acc_metric.summarize("average"), "acc_ids": list(self.acc_metric.ids),
                "held_deeper": [(m.summarize("error_rate"), list(m.ids)) for m in (
                    self.per_stage_metrics[stage.name]["wer"], self.trackers.wer, self.trackers.per_label["all"],
                    self.hparams.wer_stats)]}

    # -- arrays --------------------------------------------------------------------

    def _start_arrays(self, stage):
        name = f"{stage.name.lower()}_confusion_matrix"
        setattr(self, name, np.zeros(shape=(toy.CLASSES, toy.CLASSES), dtype=int))
        self.prob_sum = np.zeros(toy.CLASSES)

    def _batch_arrays(self, logits, labels, loss, batch, stage):
        y_true, y_pred = labels.numpy(), logits.detach().argmax(-1).numpy()
        matrix = np.bincount(y_true * toy.CLASSES + y_pred, minlength=toy.CLASSES ** 2).reshape(toy.CLASSES, -1)
        if stage == sb.Stage.VALID:
            self.valid_confusion_matrix += matrix
        else:
            self.test_confusion_matrix += matrix
        self.prob_sum += logits.detach().softmax(-1).double().sum(0).numpy()

    def _end_arrays(self, stage, stage_loss, epoch):
        matrix = getattr(self, f"{stage.name.lower()}_confusion_matrix")
        return {"confusion": matrix.tolist(), "dtype": str(matrix.dtype), "prob_sum": self.prob_sum.tolist()}

    # -- loaders -------------------------------------------------------------------

    def _start_loaders(self, stage):
        self._start_last_values(stage)
        self.loader_steps = []

    def _batch_loaders(self, logits, labels, loss, batch, stage):
        self._batch_last_values(logits, labels, loss, batch, stage)
        self.loader_steps.append(self.step)  # SpeechBrain's count, through a loader the recipe built

    def _end_loaders(self, stage, stage_loss, epoch):
        return {"n_batches": self.n_batches, "per_class": sorted(self.per_class.items()),
                "loader_steps": list(self.loader_steps), "step_at_end": self.step}

    # -- random_draws, seeded_draws: masks drawn in evaluation, as wav2vec2's and BEST-RQ's losses ----

    def _start_random_draws(self, stage):
        self.kept, self.noise = 0, 0.0

    def _batch_random_draws(self, logits, labels, loss, batch, stage):
        self.kept += int((torch.rand(len(batch.id)) < 0.5).sum())  # torch's global generator
        self.noise += random.random() + float(np.random.rand())  # Python's and NumPy's

    def _end_random_draws(self, stage, stage_loss, epoch):
        return {"kept": self.kept, "noise": self.noise}

    _start_seeded_draws = _start_random_draws

    def _batch_seeded_draws(self, logits, labels, loss, batch, stage):
        seeded = torch.Generator().manual_seed(zlib.crc32(" ".join(batch.id).encode()))  # by the batch
        self.kept += int((torch.rand(len(batch.id), generator=seeded) < 0.5).sum())
        with torch.random.fork_rng():  # or the global one, seeded by SpeechBrain's count, then put back
            torch.manual_seed(1000 + self.step)
            self.noise += float(torch.rand(1))

    _end_seeded_draws = _end_random_draws

    # -- own_average: the recipe's own update_average (OwnAverageBrain) ----------------------

    def _start_own_average(self, stage):
        self.n_batches = 0

    def _batch_own_average(self, logits, labels, loss, batch, stage):
        self.n_batches += 1

    def _end_own_average(self, stage, stage_loss, epoch):
        return {"n_batches": self.n_batches}

    # -- steps: SpeechBrain's batch count read by a batch --------------------------------

    def _start_steps(self, stage):
        self.steps_seen, self.sample_ids = [], []

    def _batch_steps(self, logits, labels, loss, batch, stage):
        self.steps_seen.append(self.step)
        if self.step <= 2:  # keep samples of the first batches, as recipes that save a few outputs do
            self.sample_ids.append(batch.id[0])

    def _end_steps(self, stage, stage_loss, epoch):
        return {"steps_seen": list(self.steps_seen), "sample_ids": list(self.sample_ids), "step_at_end": self.step}

    # -- files ---------------------------------------------------------------------

    def _start_files(self, stage):
        self.main_acc = []

    def _batch_files(self, logits, labels, loss, batch, stage):
        preds = logits.argmax(-1)
        if stage == sb.Stage.TEST:  # SLURP: predictions.jsonl, every TEST batch
            with open(self.stage_output(self.hparams.predictions_file), "a") as writer:
                for utt, pred in zip(batch.id, preds.tolist()):
                    writer.write(json.dumps({"file": utt, "scenario": pred}) + "\n")
        with open(self.hparams.eder_file, "a", encoding="utf-8") as w:  # EmoDia: without the helper
            w.write(f"    wav_id : {batch.id[0]}\n")
        if if_main_process():  # BEST-RQ: the accuracy, on the main process only
            self.main_acc.append(float((preds == labels).float().mean()))

    def _end_files(self, stage, stage_loss, epoch):
        return {"main_acc": list(self.main_acc)}

    # -- ordinary_code ---------------------------------------------------------------

    def _start_ordinary_code(self, stage):
        self.hist = [0] * toy.CLASSES
        self.spk_stats = SpeakerStats()
        self.logit_sum = torch.zeros(toy.CLASSES, dtype=torch.float64)
        self.all_preds = torch.zeros(0, dtype=torch.long)
        self.prob_total = np.zeros(toy.CLASSES)
        self.order = []
        self.last_loss = None

    def _batch_ordinary_code(self, logits, labels, loss, batch, stage):
        preds = logits.detach().argmax(-1)
        for label in labels.tolist():
            self.hist[label] += 1
        self.spk_stats.append(batch.id, preds.tolist(), labels.tolist(), [f"spk{int(u[-1]) % 3}" for u in batch.id])
        self.logit_sum = self.logit_sum + logits.detach().double().sum(0)
        self.all_preds = torch.cat([self.all_preds, preds])
        self.prob_total = self.prob_total + logits.detach().softmax(-1).double().sum(0).numpy()
        self.order = self.order + list(batch.id)
        self.last_loss = float(loss)

    def _end_ordinary_code(self, stage, stage_loss, epoch):
        return {"hist": list(self.hist), "spk": self.spk_stats.summarize(), "targets": self.spk_stats.targets,
                "logit_sum": self.logit_sum.tolist(), "all_preds": self.all_preds.tolist(),
                "prob_total": self.prob_total.tolist(), "order": list(self.order), "last_loss": self.last_loss}

    # -- idioms (issue 32) -------------------------------------------------------------

    def _start_idioms(self, stage):
        self.tally, self.ns = Tally(), types.SimpleNamespace(n=0, total=0.0)
        self.seen_labels, self.per_label, self.per_spk = set(), {}, {}
        self.transcript, self.prob_acc = "", torch.zeros(toy.CLASSES, dtype=torch.float64)
        self.per_class = collections.defaultdict(ClassStats)
        self.best_score, self.last_ids = -1.0, None
        self.utt_ids = self.every_id = self.hparams.eval_ids = []  # one list, four places (issue 37)
        self.by_stage = {stage.name: self.utt_ids}
        self.preds, self.pred_log = {}, []

    def _batch_idioms(self, logits, labels, loss, batch, stage):
        preds = logits.detach().argmax(-1)
        probs = logits.detach().softmax(-1).double()
        for utt, label, pred, prob in zip(batch.id, labels.tolist(), preds.tolist(), probs):
            self.tally.correct += int(label == pred)
            self.tally.total += float(prob[label])
            self.ns.n += 1
            self.ns.total += float(prob.max())
            self.per_label[label] = self.per_label.get(label, 0) + 1
            self.per_spk.setdefault(f"spk{int(utt[-1]) % 3}", []).append(utt)
            self.per_class[label].add(float(prob[label]) - 0.25)
            self.transcript += f"{utt} {pred}\n"
            self.preds[utt] = pred
            self.pred_log.append(self.preds[utt])  # the batch's own entry, read back: not accumulated state
        self.seen_labels |= set(labels.tolist())
        self.prob_acc.data += probs.sum(0)
        self.best_score = max(self.best_score, float(probs.max()))
        self.last_ids = list(batch.id)
        self.utt_ids.extend(batch.id)
        self.hparams.eval_ids.append(f"n{len(batch.id)}")
        self.by_stage[stage.name].append(batch.id[-1])

    def _end_idioms(self, stage, stage_loss, epoch):
        return {"tally": (self.tally.correct, self.tally.total), "ns": (self.ns.n, self.ns.total),
                "seen": sorted(self.seen_labels), "per_label": dict(self.per_label), "per_spk": dict(self.per_spk),
                "per_class": {k: (v.total, v.n) for k, v in self.per_class.items()}, "transcript": self.transcript,
                "prob_acc": self.prob_acc.tolist(), "best": self.best_score, "last_ids": self.last_ids,
                "utt_ids": list(self.utt_ids), "preds": dict(self.preds), "pred_log": list(self.pred_log),
                "aliases": (type(self.utt_ids).__name__, self.utt_ids is self.every_id
                                                           is self.hparams.eval_ids is self.by_stage[stage.name])}

    # -- unmergeable_code (issue 32) -----------------------------------------------------

    def _start_unmergeable_code(self, stage):
        self.sorted_scores, self.recent = [], collections.deque(maxlen=5)
        self.n_scores = 0
        self.first_ids = []  # the first three utterances evaluated
        self.hardest, self.newest = KeepsHardest(), NewestFirst()  # metric objects whose lists are not only appended
        self.trimmed, self.first_five = MetricStats(metric=lambda x: x), MetricStats(metric=lambda x: x)
        self.per_stage, self.early = {stage.name: {"spk": {"n": 0}}}, []  # a count three subscripts down
        self.wer_and_count = {"err": ErrorRateStats(), "n": 0}  # a metric object and a count beside it

    def _batch_unmergeable_code(self, logits, labels, loss, batch, stage):
        self.sorted_scores.append(float(loss))
        self.sorted_scores.sort()
        self.recent.extend(batch.id)
        self.n_scores = len(self.sorted_scores)
        if len(self.first_ids) < 3:  # a read of accumulated state steers the append
            self.first_ids.append(batch.id[0])
        losses = torch.nn.functional.cross_entropy(logits.detach(), labels, reduction="none")
        self.hardest.append(batch.id, losses)
        self.newest.append(batch.id, losses)
        self.trimmed.append(batch.id, losses)
        self.trimmed.ids, self.trimmed.scores = self.trimmed.ids[-4:], self.trimmed.scores[-4:]
        if len(self.first_five.ids) < 5:  # a read of the metric object's list steers its append
            self.first_five.append(batch.id, losses)
        self.per_stage[stage.name]["spk"]["n"] += len(batch.id)
        if self.per_stage[stage.name]["spk"]["n"] <= 6:  # each rank's own count
            self.early.append(batch.id[0])
        predicted = [[str(int(p))] for p in logits.argmax(-1)]
        self.wer_and_count["err"].append(batch.id, predicted, [[str(int(t))] for t in labels])
        self.wer_and_count["n"] += len(batch.id)

    def _end_unmergeable_code(self, stage, stage_loss, epoch):
        return {"sorted": list(self.sorted_scores), "recent": list(self.recent), "n_scores": self.n_scores,
                "first_ids": list(self.first_ids), "deep_n": self.per_stage[stage.name]["spk"]["n"],
                "early": list(self.early), "beside_err": self.wer_and_count["err"].summarize("error_rate"),
                "beside_n": self.wer_and_count["n"],
                **{name: list(getattr(self, name).ids) for name in ("hardest", "newest", "trimmed", "first_five")}}

    # -- modules -------------------------------------------------------------------

    def _start_modules(self, stage):
        pass

    def _batch_modules(self, logits, labels, loss, batch, stage):
        pass

    def _end_modules(self, stage, stage_loss, epoch):
        return {"count": self.hparams.input_norm.count}

    # -- outside_reads: a count kept in hparams steers an append -------------------------

    def _start_outside_reads(self, stage):
        self.odd_ids = []

    def _batch_outside_reads(self, logits, labels, loss, batch, stage):
        tally = self.hparams.tally.inner
        tally.n += 1
        if tally.n % 2:  # on a rank, its own batches' count
            self.odd_ids.append(batch.id[0])

    def _end_outside_reads(self, stage, stage_loss, epoch):
        return {"odd_ids": list(self.odd_ids)}

    # -- held_outside: a Brain list a closure and an outside object also hold -------------------

    def _start_held_outside(self, stage):
        self.ids, self.sizes, self.losses, self.labels = [], [], [], []
        self.add_id = (lambda ids: lambda i: ids.append(i))(self.ids)  # a closure's variable
        self.count_ids = (lambda report: lambda: len(report.ids))(Report(self.ids))  # an object only it holds
        self.add_loss = functools.partial(_append_to, self.losses)  # a partial's argument
        self.add_label = (lambda lists: lambda y: lists["labels"].append(y))({"labels": self.labels})  # a dict's
        global PAIR, HELD  # a tuple and a list, globals of the recipe's module the batch code names
        self.pair_ids, self.held_labels = [], []
        PAIR, HELD = (self.pair_ids, "ids"), self.held_labels
        self.kept, self.kept_sizes = self.hparams.lists["kept"], []  # a list of the YAML's, kept across stages

    def _batch_held_outside(self, logits, labels, loss, batch, stage):
        for i in batch.id:
            self.add_id(i)
        self.sizes.append(self.count_ids())  # on a rank, its own batches' ids only
        self.add_loss(round(float(loss), 6))
        for y in labels.tolist():
            self.add_label(y)
            HELD.append(y)
        PAIR[0].extend(batch.id)
        self.hparams.lists["kept"].extend(batch.id)  # appended through hparams' dict
        self.kept_sizes.append(len(self.hparams.lists["kept"]))  # read there: on a rank, its own batches' count

    def _end_held_outside(self, stage, stage_loss, epoch):
        return {"ids": list(self.ids), "sizes": list(self.sizes), "count": self.count_ids(),
                "losses": list(self.losses), "labels": list(self.labels), "held": self.add_loss.args[0] is self.losses,
                "pair_ids": list(self.pair_ids), "held_labels": list(self.held_labels),
                "globals_held": PAIR[0] is self.pair_ids and HELD is self.held_labels,
                "kept": list(self.kept), "kept_sizes": list(self.kept_sizes),
                "kept_held": self.hparams.lists["kept"] is self.kept}

    # -- training_only: a random augmentation in hparams, never called in VALID/TEST ----------

    def _start_training_only(self, stage):
        pass

    def _batch_training_only(self, logits, labels, loss, batch, stage):
        pass

    def _end_training_only(self, stage, stage_loss, epoch):
        return {}


    # -- c_reads: summaries json.dumps writes of an accumulator, per batch ---------------------

    def _start_c_reads(self, stage):
        self.loss_stats, self.by_method, self.by_helper, self.by_hparams = LossStats(), [], [], []
        self.by_spread, self.by_callback = [], []

    def _batch_c_reads(self, logits, labels, loss, batch, stage):
        self.loss_stats.update(round(float(loss), 6))
        self.by_method.append(json.dumps(self.loss_stats.snapshot()))  # what its method hands back
        self.by_helper.append(_summary(self.loss_stats, None))  # a helper's first parameter
        self.by_hparams.append(self.hparams.writers["json"](self.loss_stats))  # json.dumps in a dict
        rest = (None,)
        self.by_spread.append(_summary(self.loss_stats, *rest))  # ahead of a spread tuple
        self.by_callback.append(json.dumps(self.hparams.snapshot(self.loss_stats)))  # `!name:` of the recipe's

    def _end_c_reads(self, stage, stage_loss, epoch):
        return {"count": self.loss_stats.count, "total": self.loss_stats.total, "by_method": list(self.by_method),
                "by_helper": list(self.by_helper), "by_hparams": list(self.by_hparams),
                "by_spread": list(self.by_spread), "by_callback": list(self.by_callback)}


class LossStats:
    """An accumulator of the recipe's own."""

    def __init__(self):
        self.count, self.total = 0, 0.0

    def update(self, loss):
        self.count += 1
        self.total += loss

    def snapshot(self):
        return {"count": self.count, "total": self.total}


def _summary(stats, indent):
    return json.dumps(vars(stats), indent=indent)


def _snapshot(stats):
    return {"count": stats.count, "total": stats.total}


class DDPPatternBrain(ddp_eval.DDPEvalMixin, PatternBrain):
    """The same recipes, converted."""


class OwnAverageBrain(PatternBrain):
    """``own_average``: a recipe's own ``update_average``, without ``super()``: its
    losses, a dict of two, averaged key by key (as TTS and separation recipes average
    theirs), in every stage; the checkpoint meta keeps the total."""

    def fit_batch(self, batch):
        loss = super().fit_batch(batch)
        return {"loss": loss, "half": loss / 2}

    def evaluate_batch(self, batch, stage):
        loss = super().evaluate_batch(batch, stage)
        return {"loss": loss, "half": loss / 2}

    def update_average(self, loss, avg_loss):
        if avg_loss == 0:
            avg_loss = dict.fromkeys(loss, 0.0)
        return {key: avg_loss[key] - avg_loss[key] / self.step + float(value) / self.step
                for key, value in loss.items()}


class DDPOwnAverageBrain(ddp_eval.DDPEvalMixin, OwnAverageBrain):
    """The same recipe, converted."""


def brain_class(pattern, converted=True):
    """The Brain a pattern's recipe uses, plain or converted."""
    if pattern == "own_average":
        return DDPOwnAverageBrain if converted else OwnAverageBrain
    return DDPPatternBrain if converted else PatternBrain


def build(brain_cls, ckpt_dir, pattern, opts=None, checkpointer_cls=ddp_eval.Checkpointer, run_opts=None):
    brain = toy.build(brain_cls, ckpt_dir, ddp_eval_opts=opts, checkpointer_cls=checkpointer_cls)
    brain.pattern = pattern
    brain.seen.ids = []
    if run_opts:
        for key, value in run_opts.items():
            setattr(brain, key, value)
    if pattern == "containers":
        brain.hparams.wer_stats = ErrorRateStats()
    if pattern == "files":
        out = pathlib.Path(ckpt_dir)
        brain.hparams.predictions_file = str(out / "predictions.jsonl")
        brain.hparams.eder_file = str(out / "eder.txt")
    if pattern == "modules":
        brain.hparams.input_norm = InputNormalization()
    if pattern == "outside_reads":
        brain.hparams.tally = types.SimpleNamespace(inner=types.SimpleNamespace(n=0))
    if pattern == "held_outside":
        brain.hparams.lists = {"kept": []}  # as a YAML's `lists: {kept: []}`
    if pattern == "c_reads":
        brain.hparams.writers = {"json": functools.partial(json.dumps, default=vars)}  # `!name:json.dumps` in a dict
        brain.hparams.snapshot = functools.partial(_snapshot)  # `!name:` of a function of the recipe's
    if pattern == "training_only":
        brain.hparams.speed_perturb = SpeedPerturb(orig_freq=8000, speeds=list(range(80, 121, 4)))
    return brain


def run(brain, pattern, n_test=4, fit=True):
    """fit 2 epochs, then TEST, as the pattern's recipes feed their data."""
    train, valid, test = toy.make_dataset(8, 0), toy.make_dataset(23, 1), toy.make_dataset(n_test, 3, "tst")
    valid_set, valid_kwargs, test_set, test_kwargs = valid, {"batch_size": 3}, test, {"batch_size": 2}
    if pattern == "loaders":  # BEST-RQ, wav2vec2: loaders built by the recipe
        valid_set = SaveableDataLoader(valid, batch_size=3, collate_fn=PaddedBatch)
        test_set = LoopedLoader(DataLoader(test, batch_size=2, collate_fn=PaddedBatch), epoch_length=3)
    if fit:
        brain.fit(brain.hparams.counter, train, valid_set, train_loader_kwargs={"batch_size": 4},
                  valid_loader_kwargs=valid_kwargs)
    n_valid = len(brain.seen.ids)
    try:
        test_loss = brain.evaluate(test_set, min_key="loss", test_loader_kwargs=test_kwargs)
    except (toy.Interrupted, ddp_eval.DDPEvalError) as error:
        return {"error": type(error).__name__, "seen": brain.seen.ids[n_valid:]}
    out = {"log": brain.log, "test_loss": test_loss, "seen": {"valid": brain.seen.ids[:n_valid],
                                                             "test": brain.seen.ids[n_valid:]},
           "loaded_meta": {k: v for k, v in (brain.checkpointer.find_checkpoint(min_key="loss").meta or {}).items()
                           if k in ("loss", "epoch", "size")}}
    if pattern == "training_only":  # the state that differs across ranks, and was not used
        out["speed_perturb"] = int(brain.hparams.speed_perturb.samp_index)
    if pattern == "files":
        folder = pathlib.Path(brain.hparams.predictions_file).parent
        out["predictions"] = pathlib.Path(brain.hparams.predictions_file).read_text() if if_main_process() else None
        out["leftovers"] = sorted(p.name for p in folder.glob("*.ddp_eval-part*"))
    return out


def single_process(ckpt_dir, pattern, run_opts=None, n_test=4):
    """Plain SpeechBrain in one process: the reference."""
    brain = build(brain_class(pattern, converted=False), ckpt_dir, pattern,
                  checkpointer_cls=sb.utils.checkpoints.Checkpointer, run_opts=run_opts)
    return run(brain, pattern, n_test)


def interrupted_worker(rank, world_size, directory, pattern, fit, interrupt_after, n_test):
    """One rank of a converted recipe whose TEST stops after ``interrupt_after``
    batches on this rank (first run), or runs to the end (``None``: resumed)."""
    torch.manual_seed(0)
    brain = build(brain_class(pattern), directory, pattern, {"resume_eval_every_s": 0})
    brain.interrupt_after = interrupt_after
    return run(brain, pattern, n_test, fit)


def ranks_worker(rank, world_size, directory, patterns, opts=None, run_opts=None):
    """Every pattern on this rank, in one process group; each returns its
    outcome and the ddp_eval warnings this rank logged during it."""
    results = {}
    for pattern in patterns:
        torch.manual_seed(0)
        with ddp_eval_messages() as warnings:
            out = run(build(brain_class(pattern), os.path.join(directory, pattern), pattern, opts, run_opts=run_opts),
                      pattern)
        results[pattern] = {**out, "warnings": warnings}
    return results


def ordinary_recipe(rank, world_size, directory):
    """The toy recipe with every metric type and plain attribute (FullBrain) and the
    transformer-style saves: the ddp_eval warnings this rank logged."""
    class Converted(ddp_eval.DDPEvalMixin, toy.FullBrain):
        pass

    with ddp_eval_messages() as warnings:
        toy.run_accumulating(toy.build(Converted, directory, epochs=2))
        toy.run_recipe(toy.build(toy.DDPToyBrain, os.path.join(directory, "toy")))
    return warnings


def verify_worker(rank, world_size, directory, pattern, mode):
    """One pattern with ``ddp_eval: {verify: mode}``: its outcome, and what ddp_eval
    logged about verification on this rank (info and up)."""
    torch.manual_seed(0)
    with ddp_eval_messages(logging.INFO) as messages:
        try:
            out = run(build(brain_class(pattern), os.path.join(directory, pattern), pattern,
                            {"verify": mode, "collective_timeout": 60}), pattern)
        except ddp_eval.DDPEvalError as error:  # verify: strict, during fit's VALID
            out = {"error": type(error).__name__, "message": str(error)}
    return {**out, "verification": [m for m in messages if m.startswith("ddp_eval:") and "verif" in m]}
