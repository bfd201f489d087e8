"""WebDataset evaluation on FSDD: tar shards, a streaming pipeline, a tiny classifier.

The shards are written from the real recordings into a temporary directory by
the test (never committed).
"""

import io
import os

import soundfile
import speechbrain as sb
import torch
import webdataset as wds
from speechbrain.dataio.batch import PaddedBatch

import ddp_eval

SPEAKERS = ("jackson", "theo")


def write_shards(fsdd_dir, out_dir, per_shard=25):
    """FSDD test takes 0-4 of two speakers (100 recordings) in 4 tar shards."""
    names = sorted(f"{d}_{s}_{t}" for d in range(10) for s in SPEAKERS for t in range(5))
    with wds.ShardWriter(os.path.join(out_dir, "fsdd-%02d.tar"), maxcount=per_shard, verbose=0) as sink:
        for name in names:
            with open(os.path.join(fsdd_dir, f"{name}.wav"), "rb") as f:
                sink.write({"__key__": name, "wav": f.read(), "cls": name.split("_")[0]})
    return sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".tar"))


def _decode(sample):
    audio, _ = soundfile.read(io.BytesIO(sample["wav"]), dtype="float32")
    return {"id": sample["__key__"], "sig": torch.from_numpy(audio), "label": int(sample["cls"])}


def stream(shards, split_by_node=False):
    """The eval stream: every rank reads every shard, or its own (split_by_node)."""
    splitter = wds.split_by_node if split_by_node else (lambda urls: urls)
    return wds.WebDataset(shards, nodesplitter=splitter, shardshuffle=False, empty_check=False).map(_decode)


class DigitBrain(sb.Brain):
    def compute_forward(self, batch, stage):
        wavs, lens = batch.sig  # 64 frame energies of each utterance, padding excluded
        sizes = (lens * wavs.shape[1]).round().long()
        frames = torch.stack([w[: int(n) // 64 * 64].reshape(64, -1).abs().mean(-1)
                              for w, n in zip(wavs, sizes)])
        return self.modules.model(frames.log1p())

    def compute_objectives(self, logits, batch, stage):
        labels = torch.as_tensor(batch.label)
        preds = logits.argmax(-1)
        self.stats.append(batch.id, [str(int(p)) for p in preds], [str(int(t)) for t in labels])
        self.acc_metric.append(float((preds == labels).float().mean()))
        for utt, row in zip(batch.id, logits):
            self.scores[utt] = row.tolist()
        return torch.nn.functional.cross_entropy(logits, labels)

    def on_stage_start(self, stage, epoch=None):
        self.stats, self.acc_metric, self.scores = sb.utils.metric_stats.ClassificationStats(), [], {}

    def on_stage_end(self, stage, stage_loss, epoch=None):
        self.result = {"loss": stage_loss, "accuracy": self.stats.summarize("accuracy"),
                       "ids": list(self.stats.ids), "acc_metric": self.acc_metric,
                       "scores": dict(self.scores)}


class DDPDigitBrain(ddp_eval.DDPEvalMixin, DigitBrain):
    pass


def evaluate(brain_cls, shards, split_by_node=False, ddp_eval_opts=None):
    torch.manual_seed(0)
    hparams = {"ddp_eval": ddp_eval_opts} if ddp_eval_opts else {}
    brain = brain_cls({"model": torch.nn.Linear(64, 10)}, hparams=hparams,
                      run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo"})
    brain.evaluate(stream(shards, split_by_node), test_loader_kwargs={"batch_size": 4, "collate_fn": PaddedBatch})
    return brain.result


def worker(rank, world_size, shards, split_by_node):
    opts = {"stream_split": "by_dataset"} if split_by_node else None
    return evaluate(DDPDigitBrain, shards, split_by_node, opts)
