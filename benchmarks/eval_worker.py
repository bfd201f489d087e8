"""One benchmark job, run under torchrun by run_benchmark.py.

Modes
-----
plain   : sb.Brain, every rank evaluates the whole set (SpeechBrain today)
mixin   : DDPEvalMixin, each rank evaluates its shard (no journal: no checkpointer)
mixin+journal, mixin+journal0 : the same, journaling for resume_eval every 60 s
          (the default) or after every batch, into out/journal-<mode>
mixin+verify : the same with ``verify: first`` (each rank evaluates the stage again as
          one process would, and compares)
merge   : cost of the cross-rank merge of 10,000 utterances of metric state

Writes a JSON line of measurements from rank 0 to the file given as argv[3].
"""

import json
import logging
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

import speechbrain as sb  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import ConvGRUEncoder, normalize_utterances  # noqa: E402

import ddp_eval  # noqa: E402


class _Timed:
    """Records when this rank's last batch finished (its busy time)."""

    def update_average(self, loss, avg_loss):
        self.last_batch_end = time.perf_counter()
        return super().update_average(loss, avg_loss)


def _eval_brain_class(base):
    class EvalBrain(_Timed, base):
        def compute_forward(self, batch, stage):
            wavs, lens = batch.sig
            feats, _ = normalize_utterances(self.hparams.fbank(wavs), lens)
            return self.modules.encoder(feats).log_softmax(-1), lens

        def compute_objectives(self, predictions, batch, stage):
            log_probs, lens = predictions
            hyps = sb.decoders.ctc_greedy_decode(log_probs, lens, blank_id=0)
            self.wer.append(batch.id, [[str(h)] for h in hyps], [[w] for w in batch.word])
            return log_probs.mean()

        def on_stage_start(self, stage, epoch=None):
            self.wer = sb.utils.metric_stats.ErrorRateStats()

        def on_stage_end(self, stage, stage_loss, epoch=None):
            self.summary = self.wer.summarize()

    return EvalBrain


def _dataset(manifest):
    ds = sb.dataio.dataset.DynamicItemDataset.from_json(manifest)

    @sb.utils.data_pipeline.takes("wav")
    @sb.utils.data_pipeline.provides("sig")
    def audio(wav):
        return sb.dataio.dataio.read_audio(wav)

    ds.add_dynamic_item(audio)
    ds.set_output_keys(["id", "sig", "word"])
    return ds


def _gather(value):
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def evaluation(mode, manifest):
    torch.manual_seed(0)
    encoder = ConvGRUEncoder(n_mels=40, hidden=192, n_outputs=16)
    hparams = {"fbank": sb.lobes.features.Fbank(sample_rate=8000, n_fft=256, n_mels=40)}
    # The timing probe is a float set in every batch: left rank-local, as the README says to.
    hparams["ddp_eval"] = {"attributes_exclude": ["last_batch_end"]}
    if mode.startswith("mixin+journal"):
        hparams["ddp_eval"].update(resume_eval_dir=os.path.join(os.path.dirname(manifest), f"journal-{mode}"),
                                   resume_eval_every_s=0 if mode.endswith("0") else 60)
    if mode == "mixin+verify":
        hparams["ddp_eval"]["verify"] = "first"
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ddp_eval").addHandler(handler)
    logging.getLogger("ddp_eval").setLevel(logging.INFO)
    base = sb.Brain if mode == "plain" else type("M", (ddp_eval.DDPEvalMixin, sb.Brain), {})
    brain = _eval_brain_class(base)(
        modules={"encoder": encoder}, hparams=hparams,
        run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo"})
    data = _dataset(manifest)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    brain.evaluate(data, test_loader_kwargs={"batch_size": 8})
    total = time.perf_counter() - start
    busy = brain.last_batch_end - start
    return {"eval_s": max(_gather(total)), "busy_s": _gather(busy), "utterances": len(data),
            "summary_wer": brain.summary["WER"], "verification": [m for m in said if "verif" in m]}


def merge_cost(n_utterances=10000, batch=10):
    """Times the mixin's stage-end merge of ErrorRateStats and BinaryMetricStats."""
    class MergeBrain(ddp_eval.DDPEvalMixin, sb.Brain):
        def compute_forward(self, batch, stage):
            return batch

        def compute_objectives(self, batch, _, stage):
            ids = [f"u{int(i):05d}" for i in batch]
            words = [[f"w{int(i) % 7}", "x", f"y{int(i) % 3}"] for i in batch]
            self.wer.append(ids, words, [[w[0], "x", "z"] for w in words])
            self.binary.append(ids, (batch % 10).float() / 10, (batch % 2).long())
            return torch.tensor(0.0)

        def on_stage_start(self, stage, epoch=None):
            self.wer = sb.utils.metric_stats.ErrorRateStats()
            self.binary = sb.utils.metric_stats.BinaryMetricStats()

        def on_stage_end(self, stage, stage_loss, epoch=None):
            self.synced_at = time.perf_counter()

    # The timing probe is a float set in every batch: left rank-local, as the README says to.
    brain = MergeBrain(modules={}, hparams={"ddp_eval": {"attributes_exclude": ["last"]}},
                       run_opts={"device": "cpu", "noprogressbar": True})
    brain.last = None
    orig = brain.update_average

    def timed_update(loss, avg):
        brain.last = time.perf_counter()
        return orig(loss, avg)

    brain.update_average = timed_update
    dist.barrier()
    start = time.perf_counter()
    brain.evaluate(list(range(n_utterances)), test_loader_kwargs={"batch_size": batch})
    total = time.perf_counter() - start
    # sync cost = stage end (after the slowest rank's last batch) to the end of the merge
    last = max(_gather(brain.last - start))
    return {"merge_ms": (brain.synced_at - start - last) * 1000, "merge_eval_s": total,
            "utterances": n_utterances, "merged_ids": len(brain.wer.ids)}


if __name__ == "__main__":
    mode, manifest, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    result = merge_cost() if mode == "merge" else evaluation(mode, manifest)
    if not dist.is_initialized() or dist.get_rank() == 0:
        result.update(mode=mode, world_size=dist.get_world_size() if dist.is_initialized() else 1)
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
