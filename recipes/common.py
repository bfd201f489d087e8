"""Pieces shared by the ddp_eval recipes: tiny models, feature normalisation, data manifests.

Models avoid BatchNorm: SpeechBrain turns it into SyncBatchNorm under DDP,
which cannot run on CPU.
"""

import json
import os

import torch


def normalize_utterances(feats, lens):
    """Per-utterance mean/variance normalisation (no running statistics, so
    every rank normalises exactly as one process would)."""
    steps = torch.arange(feats.shape[1], device=feats.device)[None, :]
    mask = (steps < (lens * feats.shape[1]).round()[:, None]).unsqueeze(-1).float()
    count = mask.sum(1, keepdim=True).clamp(min=1)
    mean = (feats * mask).sum(1, keepdim=True) / count
    var = (((feats - mean) * mask) ** 2).sum(1, keepdim=True) / count
    return (feats - mean) / (var + 1e-5).sqrt() * mask, mask


class ConvClassifier(torch.nn.Module):
    """Two 1-D convolutions, masked mean pooling over time, a linear layer."""

    def __init__(self, n_mels=40, hidden=64, n_classes=10):
        super().__init__()
        self.conv = torch.nn.Sequential(
            torch.nn.Conv1d(n_mels, hidden, 5, padding=2), torch.nn.ReLU(),
            torch.nn.Conv1d(hidden, hidden, 5, padding=2), torch.nn.ReLU(),
        )
        self.out = torch.nn.Linear(hidden, n_classes)

    def forward(self, feats, mask):
        hidden = self.conv(feats.transpose(1, 2)).transpose(1, 2)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.out(pooled)


class ConvGRUEncoder(torch.nn.Module):
    """A convolution then a bidirectional GRU; per-frame scores for CTC."""

    def __init__(self, n_mels=40, hidden=64, n_outputs=16):
        super().__init__()
        self.conv = torch.nn.Sequential(torch.nn.Conv1d(n_mels, hidden, 5, padding=2), torch.nn.ReLU())
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.out = torch.nn.Linear(2 * hidden, n_outputs)

    def forward(self, feats):
        hidden = self.conv(feats.transpose(1, 2)).transpose(1, 2)
        hidden, _ = self.gru(hidden)
        return self.out(hidden)


def write_manifest(path, entries):
    """Writes a SpeechBrain JSON manifest, sorted by duration (ascending)."""
    entries = dict(sorted(entries.items(), key=lambda kv: (kv[1]["duration"], kv[0])))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(tmp, path)


# --- shared recipe plumbing ------------------------------------------------

import speechbrain as sb  # noqa: E402
from speechbrain.utils.distributed import if_main_process  # noqa: E402

from ddp_eval import DDPEvalMixin  # noqa: E402


def audio_datasets(hparams, label_pipeline):
    """train/valid/test DynamicItemDatasets from the JSON manifests of data prep."""
    @sb.utils.data_pipeline.takes("wav")
    @sb.utils.data_pipeline.provides("sig")
    def audio_pipeline(wav):
        return sb.dataio.dataio.read_audio(wav)

    datasets = {}
    for split in ("train", "valid", "test"):
        datasets[split] = sb.dataio.dataset.DynamicItemDataset.from_json(
            json_path=f"{hparams['save_folder']}/{split}.json")
    sb.dataio.dataset.add_dynamic_item(list(datasets.values()), audio_pipeline)
    sb.dataio.dataset.add_dynamic_item(list(datasets.values()), label_pipeline)
    keys = ["id", "sig"] + list(label_pipeline.provides)
    sb.dataio.dataset.set_output_keys(list(datasets.values()), keys)
    return datasets


class RecipeBrain(DDPEvalMixin, sb.Brain):
    """What the recipes share: logging, the scheduler step, checkpoints, test reports.

    Subclasses define ``key_metric`` (lower is better), ``metric_summary()`` and
    ``write_test_reports()``.
    """

    key_metric = "error_rate"

    def on_stage_end(self, stage, stage_loss, epoch=None):
        stats = {"loss": stage_loss}
        if stage != sb.Stage.TRAIN:
            stats.update(self.metric_summary())
        if stage == sb.Stage.TRAIN:
            self.train_stats = stats
        elif stage == sb.Stage.VALID:
            old_lr, new_lr = self.hparams.lr_annealing(stats[self.key_metric])
            sb.nnet.schedulers.update_learning_rate(self.optimizer, new_lr)
            self.hparams.train_logger.log_stats(
                {"epoch": epoch, "lr": old_lr}, train_stats=self.train_stats, valid_stats=stats)
            self.checkpointer.save_and_keep_only(meta=stats, min_keys=[self.key_metric])
        else:
            self.hparams.train_logger.log_stats(
                {"Epoch loaded": self.hparams.epoch_counter.current}, test_stats=stats)
            if if_main_process():
                self.write_test_reports()


class ClassifierBrain(RecipeBrain):
    """Utterance classification: Fbank, per-utterance normalisation, a ConvClassifier."""

    def compute_forward(self, batch, stage):
        wavs, lens = batch.sig
        feats, mask = normalize_utterances(self.hparams.compute_features(wavs), lens)
        return self.modules.model(feats, mask)

    def compute_objectives(self, logits, batch, stage):
        labels = batch.label_encoded.data[:, 0]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if stage != sb.Stage.TRAIN:
            preds = logits.argmax(-1)
            self.classification_stats.append(
                batch.id, [str(int(p)) for p in preds], [str(int(t)) for t in labels])
            self.error_stats.append(batch.id, preds, labels)
        return loss

    def on_stage_start(self, stage, epoch=None):
        if stage != sb.Stage.TRAIN:
            self.classification_stats = sb.utils.metric_stats.ClassificationStats()
            self.error_stats = sb.utils.metric_stats.MetricStats(
                metric=lambda preds, labels: (preds != labels).float())

    def metric_summary(self):
        return {"error_rate": self.error_stats.summarize("average"),
                "accuracy": self.classification_stats.summarize("accuracy")}

    def write_test_reports(self):
        with open(self.hparams.test_report, "w") as f:
            self.classification_stats.write_stats(f)


def label_pipeline():
    """Integer class label of a manifest entry, as a 1-element tensor."""
    @sb.utils.data_pipeline.takes("label")
    @sb.utils.data_pipeline.provides("label_encoded")
    def pipeline(label):
        return torch.LongTensor([int(label)])

    return pipeline


def run_recipe(brain_class, prepare, prepare_kwargs_keys, labels, min_key):
    """SpeechBrain-style main: parse args, prepare data on main, fit, evaluate.

    Arguments
    ---------
    brain_class : type
        The recipe's Brain (inherits DDPEvalMixin).
    prepare : callable
        Data preparation, run on the main process only.
    prepare_kwargs_keys : list of str
        hparams passed to ``prepare``.
    labels : DynamicItem
        The label pipeline.
    min_key : str
        Metric whose best checkpoint is evaluated on the test set.
    """
    import sys

    from hyperpyyaml import load_hyperpyyaml

    hparams_file, run_opts, overrides = sb.parse_arguments(sys.argv[1:])
    sb.utils.distributed.ddp_init_group(run_opts)
    with open(hparams_file, encoding="utf-8") as fin:
        hparams = load_hyperpyyaml(fin, overrides)
    sb.create_experiment_directory(hparams["output_folder"], hyperparams_to_save=hparams_file,
                                   overrides=overrides)
    sb.utils.distributed.run_on_main(
        prepare, kwargs={k: hparams[k] for k in prepare_kwargs_keys})
    datasets = audio_datasets(hparams, labels)
    brain = brain_class(modules=hparams["modules"], opt_class=hparams["opt_class"],
                            hparams=hparams, run_opts=run_opts, checkpointer=hparams["checkpointer"])
    brain.fit(hparams["epoch_counter"], datasets["train"], datasets["valid"],
              train_loader_kwargs=hparams["train_dataloader_opts"],
              valid_loader_kwargs=hparams["valid_dataloader_opts"])
    brain.evaluate(datasets["test"], min_key=min_key,
                   test_loader_kwargs=hparams["test_dataloader_opts"])
