"""A tiny SpeechBrain recipe used by the tests: data, model, Brain, metrics.

Everything is deterministic, so one process and N processes can be compared.
"""

import io
import os
import types

import speechbrain as sb
import torch
from speechbrain.dataio.batch import PaddedBatch
from speechbrain.dataio.dataset import DynamicItemDataset
from speechbrain.dataio.sampler import DynamicBatchSampler
from speechbrain.utils.Accuracy import AccuracyStats
from speechbrain.utils.checkpoints import mark_as_loader, mark_as_saver, register_checkpoint_hooks
from speechbrain.utils.metric_stats import (
    BinaryMetricStats,
    ClassificationStats,
    ErrorRateStats,
    MetricStats,
    MultiMetricStats,
)
from torch.utils.data import DataLoader

import ddp_eval

FEATS = 4
CLASSES = 3


def make_dataset(n, seed=0, prefix="utt"):
    """n utterances of random length (3..12 frames), sorted by length like SpeechBrain data prep."""
    g = torch.Generator().manual_seed(seed)
    data = {}
    for i in range(n):
        length = int(torch.randint(3, 13, (1,), generator=g))
        data[f"{prefix}{i:03d}"] = {
            "feats": torch.randn(length, FEATS, generator=g).tolist(),
            "target": int(torch.randint(0, CLASSES, (1,), generator=g)),
            "length": length,
        }
    data = dict(sorted(data.items(), key=lambda kv: kv[1]["length"]))
    ds = DynamicItemDataset(data)

    @sb.utils.data_pipeline.takes("feats", "target")
    @sb.utils.data_pipeline.provides("x", "label")
    def pipeline(x, label):
        yield torch.tensor(x)
        yield torch.tensor([label])

    ds.add_dynamic_item(pipeline)
    ds.set_output_keys(["id", "x", "label"])
    return ds


def dynamic_batches(ds):
    lengths = [ds.data[i]["length"] for i in ds.data_ids]
    return DynamicBatchSampler(ds, max_batch_length=20, num_buckets=3, length_func=lambda d: d["length"],
                               shuffle=False, batch_ordering="ascending", lengths_list=lengths)


def make_model(batchnorm=False, seed=1):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(FEATS, 8)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(8))
    layers += [torch.nn.Tanh(), torch.nn.Linear(8, CLASSES)]
    return torch.nn.Sequential(*layers)


def _multi(a, b):
    return {"diff": (a - b).abs(), "prod": a * b}


def _summaries(brain):
    """Summaries and write_stats text of every metric, for exact comparison."""
    out = {}
    for name in ("err", "wer", "cls", "binary", "acc", "multi"):
        metric = getattr(brain, name)
        if name == "acc":
            out[name] = (metric.summarize(), metric.correct, metric.total)
            continue
        if name == "binary":
            summary = metric.summarize(threshold=0.5)
        else:
            summary = metric.summarize()
        text = io.StringIO()
        if name in ("err", "wer", "cls"):
            metric.write_stats(text)
        out[name] = (summary, text.getvalue(), list(metric.ids))
    return out


@register_checkpoint_hooks
class WriterProbe:
    """A recoverable whose checkpoint file records which rank wrote it."""

    def __init__(self):
        self.loaded = None

    @mark_as_saver
    def save(self, path):
        with open(path, "w") as f:
            f.write(os.environ.get("RANK", "single"))

    @mark_as_loader
    def load(self, path, end_of_epoch):
        with open(path) as f:
            self.loaded = f.read()


class ToyBrain(sb.Brain):
    """Plain SpeechBrain recipe: metrics created in on_stage_start, scheduler and checkpoint in on_stage_end."""

    def compute_forward(self, batch, stage):
        x, lens = batch.x
        mask = (torch.arange(x.shape[1])[None, :] < (lens * x.shape[1]).round()[:, None]).float()
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.modules.model(pooled)

    def compute_objectives(self, logits, batch, stage):
        labels = batch.label.data[:, 0]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if stage != sb.Stage.TRAIN:
            self.seen.ids.extend(batch.id)
            logp = logits.log_softmax(-1)
            preds = logp.argmax(-1)
            self.err.append(batch.id, logp, labels)
            self.wer.append(batch.id, [[str(int(p)), "a"] for p in preds],
                            [[str(int(t)), "a", "b"][: 2 + int(t) % 2] for t in labels])
            self.cls.append(batch.id, [f"d{int(p)}" for p in preds], [f"d{int(t)}" for t in labels])
            self.binary.append(batch.id, logp[:, 1].exp(), (labels == 1).long())
            self.acc.append(logp.unsqueeze(1), labels.unsqueeze(1), torch.ones(len(labels)))
            self.multi.append(batch.id, a=logp[:, 0], b=logp[:, 2])
        return loss

    def on_stage_start(self, stage, epoch=None):
        if stage != sb.Stage.TRAIN:
            self.err = MetricStats(metric=lambda logp, y: -logp.gather(1, y[:, None])[:, 0])
            self.wer = ErrorRateStats()
            self.cls = ClassificationStats()
            self.binary = BinaryMetricStats()
            self.acc = AccuracyStats()
            self.multi = MultiMetricStats(metric=_multi, batch_eval=True)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        record = {"stage": stage.name, "loss": stage_loss, "epoch": epoch}
        if stage != sb.Stage.TRAIN:
            record["metrics"] = _summaries(self)
        if stage == sb.Stage.VALID:
            self.hparams.scheduler(stage_loss)
            record["scheduler"] = (self.hparams.scheduler.hyperparam_value,
                                   list(self.hparams.scheduler.metric_values))
            self.checkpointer.save_and_keep_only(meta={"loss": stage_loss}, min_keys=["loss"])
        self.log.append(record)


class DDPToyBrain(ddp_eval.DDPEvalMixin, ToyBrain):
    """The same recipe converted: inherits the mixin."""


def build(brain_cls, ckpt_dir, checkpointer_cls=ddp_eval.Checkpointer, lr=0.0, ddp_eval_opts=None,
          batchnorm=False, epochs=2, optimizer=torch.optim.SGD, run_opts=None):
    model = make_model(batchnorm)
    counter = sb.utils.epoch_loop.EpochCounter(epochs)
    scheduler = sb.nnet.schedulers.NewBobScheduler(initial_value=1.0, improvement_threshold=10.0)
    probe = WriterProbe()
    checkpointer = checkpointer_cls(ckpt_dir, recoverables={
        "model": model, "counter": counter, "scheduler": scheduler, "probe": probe})
    hparams = {"scheduler": scheduler, "counter": counter, "probe": probe,
               "ddp_eval": with_seen_excluded(ddp_eval_opts)}
    brain = brain_cls(modules={"model": model}, opt_class=lambda p: optimizer(p, lr=lr),
                      hparams=hparams, checkpointer=checkpointer,
                      run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo",
                                **(run_opts or {})})
    brain.log = []
    brain.seen = types.SimpleNamespace(ids=[])  # a holder, not a list: never merged
    return brain


def with_seen_excluded(ddp_eval_opts=None):
    """The ddp_eval section of a toy Brain: ``seen``, the test's record of what this
    rank evaluated, stays rank-local (it is an object whose contents change)."""
    if ddp_eval_opts is not None and not isinstance(ddp_eval_opts, dict):
        return ddp_eval_opts  # a wrong section, kept as it is for the tests of its error
    opts = dict(ddp_eval_opts or {})
    exclude = opts.get("attributes_exclude", [])
    opts["attributes_exclude"] = ["seen"] + exclude if isinstance(exclude, list) else exclude
    return opts


def run_recipe(brain, n_train=10, n_valid=23, n_test=23, n_tiny=2):
    """fit (VALID with batch_size 3), evaluate with DynamicBatchSampler, a tiny test
    set, then a ready DataLoader as the recipe built it (the mixin shards it) and
    sharded with ddp_eval.shard_dataloader. Returns what each pass saw."""
    train, valid, test, tiny = (make_dataset(n_train, 0), make_dataset(n_valid, 1),
                                make_dataset(n_test, 2, "tst"), make_dataset(n_tiny, 3, "tiny"))
    seen = {}

    def run(name, call):
        start = len(brain.seen.ids)
        result = call()
        seen[name] = brain.seen.ids[start:]
        return result

    run("fit", lambda: brain.fit(brain.hparams.counter, train, valid,
                                 train_loader_kwargs={"batch_size": 4},
                                 valid_loader_kwargs={"batch_size": 3}))
    test_loss = run("test", lambda: brain.evaluate(
        test, min_key="loss", test_loader_kwargs={"batch_sampler": dynamic_batches(test)}))
    tiny_loss = run("tiny", lambda: brain.evaluate(
        tiny, min_key="loss", test_loader_kwargs={"batch_size": 1}))
    ready = DataLoader(test, batch_size=4, collate_fn=PaddedBatch)
    ready_loss = run("ready", lambda: brain.evaluate(ready, min_key="loss"))
    sharded_loss = run("ready_sharded", lambda: brain.evaluate(
        ddp_eval.shard_dataloader(ready), min_key="loss"))
    return {"log": brain.log, "test_loss": test_loss, "tiny_loss": tiny_loss,
            "ready_loss": ready_loss, "ready_sharded_loss": sharded_loss,
            "seen": seen, "probe_loaded": brain.hparams.probe.loaded}


class AccumulatingBrain(ToyBrain):
    """Accumulates as SpeechBrain recipes do: plain lists, counters, a dict and
    accumulators on the Brain, reduced in on_stage_end (sum/len of a list)."""

    def compute_objectives(self, logits, batch, stage):
        labels = batch.label.data[:, 0]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if stage != sb.Stage.TRAIN:
            self.seen.ids.extend(batch.id)
            preds = logits.argmax(-1)
            self.acc_metric.append((preds == labels).float().mean())  # as the wav2vec2 recipes
            self.n_correct += int((preds == labels).sum())
            self.n_seen += len(batch.id)
            for utt, pred in zip(batch.id, preds):
                self.predictions[utt] = int(pred)
            self.loss_total += float(loss)
            self.confusion += torch.nn.functional.one_hot(labels * CLASSES + preds, CLASSES ** 2).sum(0)
        return loss

    def on_stage_start(self, stage, epoch=None):
        if stage != sb.Stage.TRAIN:
            self.acc_metric, self.predictions = [], {}
            self.n_correct, self.n_seen, self.loss_total = 0, 0, 0.0
            self.confusion = torch.zeros(CLASSES ** 2, dtype=torch.long)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage != sb.Stage.TRAIN:
            self.log.append({
                "stage": stage.name, "loss": stage_loss,
                "valid_acc": float(sum(self.acc_metric) / len(self.acc_metric)),
                "acc_metric": [float(a) for a in self.acc_metric],
                "counters": (self.n_correct, self.n_seen),
                "predictions": list(self.predictions.items()),
                "loss_total": self.loss_total, "confusion": self.confusion.tolist()})


class UtteranceStream(torch.utils.data.IterableDataset):
    """A streaming view of a DynamicItemDataset (every rank reads all of it)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return (self.dataset[i] for i in range(len(self.dataset)))


def run_accumulating(brain, stream=False):
    """fit with VALID = 29 items at batch 3 (10 batches), then evaluate 4 items
    (2 batches: an idle rank from 3 ranks on); both streamed if ``stream``."""
    valid, test = make_dataset(29, 1), make_dataset(4, 3, "tst")
    kwargs = {"batch_size": 3}
    if stream:
        valid, test = UtteranceStream(valid), UtteranceStream(test)
        kwargs = {"batch_size": 3, "collate_fn": PaddedBatch}
    brain.fit(brain.hparams.counter, make_dataset(8, 0), valid,
              train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs=kwargs)
    brain.evaluate(test, test_loader_kwargs=kwargs)
    return {"log": brain.log, "seen": brain.seen.ids}


class TensorStateBrain(sb.Brain):
    """Keeps tensors on the Brain as recipes do: a large table it only reads (a
    prior, centroids), per-utterance counts in an int64 tensor, and float64
    accumulators, one small and one large (``acc_mb``)."""

    def __init__(self, *args, table_mb=32, counts_mb=8, acc_mb=8, **kwargs):
        super().__init__(*args, **kwargs)
        self.table = torch.randn(table_mb * 2**18, generator=torch.Generator().manual_seed(5))
        self.sizes = (counts_mb * 2**17, acc_mb * 2**17)

    def compute_forward(self, batch, stage):
        x, lens = batch.x
        return self.modules.model(x.mean(1)) + self.table[:CLASSES]  # the table is only read

    def compute_objectives(self, logits, batch, stage):
        labels = batch.label.data[:, 0]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if stage != sb.Stage.TRAIN:
            self.seen.ids.extend(batch.id)
            slots = torch.tensor([int(i[3:]) * 7919 % len(self.counts) for i in batch.id])
            self.counts.index_add_(0, slots, torch.ones(len(slots), dtype=torch.long))
            self.acc_small += logits.double().sum(0)
            pattern = torch.arange(len(self.acc_big), dtype=torch.float64).remainder_(7).add_(1)
            self.acc_big.add_(pattern, alpha=float(loss))
        return loss

    def on_stage_start(self, stage, epoch=None):
        if stage != sb.Stage.TRAIN:
            self.counts = torch.zeros(self.sizes[0], dtype=torch.long)
            self.acc_small = torch.zeros(CLASSES, dtype=torch.float64)
            self.acc_big = torch.zeros(self.sizes[1], dtype=torch.float64)


def build_tensor_state(brain_cls, **sizes):
    brain = brain_cls(modules={"model": make_model()}, hparams={"ddp_eval": with_seen_excluded()},
                      run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo"},
                      **sizes)
    brain.seen = types.SimpleNamespace(ids=[])
    return brain


class FullBrain(AccumulatingBrain):
    """Every metric type of ToyBrain and the plain attributes of AccumulatingBrain.

    ``interrupt_after`` (set on the instance) raises ``Interrupted`` once that
    many TEST batches were evaluated in this process; ``seen.batches`` counts
    them (a holder the mixin does not merge), ``seen.ids`` their utterances.
    """

    interrupt_after = None

    def compute_objectives(self, logits, batch, stage):
        if stage == sb.Stage.TEST:
            self.seen.batches = getattr(self.seen, "batches", 0) + 1
            if self.interrupt_after is not None and self.seen.batches > self.interrupt_after:
                raise Interrupted(f"interrupted after {self.interrupt_after} batches")
        loss = AccumulatingBrain.compute_objectives(self, logits, batch, stage)
        if stage != sb.Stage.TRAIN:
            self.seen.ids = self.seen.ids[: -len(batch.id)]  # counted once, by ToyBrain below
            ToyBrain.compute_objectives(self, logits, batch, stage)
        return loss

    def on_stage_start(self, stage, epoch=None):
        AccumulatingBrain.on_stage_start(self, stage, epoch)
        ToyBrain.on_stage_start(self, stage, epoch)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage == sb.Stage.TEST:
            AccumulatingBrain.on_stage_end(self, stage, stage_loss, epoch)
            self.log[-1]["metrics"] = _summaries(self)


class Interrupted(RuntimeError):
    """A stand-in for a preemption, raised inside the evaluation loop."""


class TransformerStyleBrain(ToyBrain):
    """Saves as SpeechBrain's transformer recipes (LibriSpeech, CommonVoice,
    Switchboard, ...) do: VALID's checkpoint under ``if if_main_process():``, an
    "averaged" one at TEST end on every rank, and ``on_evaluate_start`` averaging
    the best checkpoints (``find_checkpoints`` + ``average_checkpoints``). The
    model changes by a fixed rule each epoch (the same on every rank), so the
    checkpoints differ."""

    def on_stage_end(self, stage, stage_loss, epoch=None):
        from speechbrain.utils.distributed import if_main_process

        record = {"stage": stage.name, "loss": stage_loss, "epoch": epoch}
        if stage == sb.Stage.TRAIN:
            with torch.no_grad():
                for param in self.checkpointer.recoverables["model"].parameters():
                    param.mul_(0.5 + 0.1 * epoch)
        else:
            record["metrics"] = _summaries(self)
        if stage == sb.Stage.VALID and if_main_process():
            self.checkpointer.save_and_keep_only(meta={"loss": stage_loss, "epoch": epoch},
                                                 min_keys=["loss"], num_to_keep=2)
        elif stage == sb.Stage.TEST:
            self.checkpointer.save_and_keep_only(meta={"loss": -1.0, "epoch": epoch},
                                                 min_keys=["loss"], num_to_keep=1)
        self.log.append(record)

    def on_evaluate_start(self, max_key=None, min_key=None):
        super().on_evaluate_start(max_key=max_key, min_key=min_key)
        ckpts = self.checkpointer.find_checkpoints(max_key=max_key, min_key=min_key)
        averaged = sb.utils.checkpoints.average_checkpoints(ckpts, recoverable_name="model")
        self.checkpointer.recoverables["model"].load_state_dict(averaged)
        self.log.append({"averaged": sorted(c.meta["epoch"] for c in ckpts)})


def run_transformer_style(brain):
    """fit 3 epochs, then TEST (6 items, batch 3: 2 batches, so a third rank has
    none) from the average of the 2 best checkpoints."""
    brain.fit(brain.hparams.counter, make_dataset(10, 0), make_dataset(23, 1),
              train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 3})
    test_loss = brain.evaluate(make_dataset(6, 3, "tst"), min_key="loss", test_loader_kwargs={"batch_size": 3})
    brain.checkpointer.wait() if hasattr(brain.checkpointer, "wait") else None
    kept = sorted(c.meta["epoch"] for c in brain.checkpointer.list_checkpoints())
    return {"log": brain.log, "test_loss": test_loss, "kept": kept}
