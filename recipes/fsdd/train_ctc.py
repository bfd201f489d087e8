#!/usr/bin/env python3
"""FSDD character-level CTC recogniser of the spoken word ("seven"), scored with
ErrorRateStats (WER on words, CER on characters).

    torchrun --standalone --nproc_per_node=2 recipes/fsdd/train_ctc.py \
        hparams/fsdd_ctc.yaml --data_folder=PATH/TO/recordings \
        --distributed_backend=gloo --device=cpu
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import speechbrain as sb  # noqa: E402
from common import RecipeBrain, normalize_utterances, run_recipe  # noqa: E402

from fsdd.fsdd_prepare import prepare_fsdd  # noqa: E402

BLANK = "_"
CHARS = [BLANK] + sorted(set("zeroonetwothreefourfivesixseveneightnine"))


class CTCBrain(RecipeBrain):
    key_metric = "CER"

    def compute_forward(self, batch, stage):
        wavs, lens = batch.sig
        feats, _ = normalize_utterances(self.hparams.compute_features(wavs), lens)
        return self.modules.encoder(feats).log_softmax(-1), lens

    def compute_objectives(self, predictions, batch, stage):
        log_probs, lens = predictions
        tokens, token_lens = batch.tokens
        loss = sb.nnet.losses.ctc_loss(log_probs, tokens, lens, token_lens, blank_index=0)
        if stage != sb.Stage.TRAIN:
            hyps = sb.decoders.ctc_greedy_decode(log_probs, lens, blank_id=0)
            words = ["".join(CHARS[i] for i in hyp) for hyp in hyps]
            self.wer_metric.append(batch.id, [[w] for w in words], [[w] for w in batch.word])
            self.cer_metric.append(batch.id, [list(w) for w in words], [list(w) for w in batch.word])
        return loss

    def on_stage_start(self, stage, epoch=None):
        if stage != sb.Stage.TRAIN:
            self.wer_metric = sb.utils.metric_stats.ErrorRateStats()
            self.cer_metric = sb.utils.metric_stats.ErrorRateStats()

    def metric_summary(self):
        return {"WER": self.wer_metric.summarize("error_rate"),
                "CER": self.cer_metric.summarize("error_rate")}

    def write_test_reports(self):
        with open(self.hparams.test_wer_file, "w") as f:
            self.wer_metric.write_stats(f)
        with open(self.hparams.test_cer_file, "w") as f:
            self.cer_metric.write_stats(f)


@sb.utils.data_pipeline.takes("word")
@sb.utils.data_pipeline.provides("word", "tokens")
def word_pipeline(word):
    yield word
    yield torch.LongTensor([CHARS.index(c) for c in word])


if __name__ == "__main__":
    run_recipe(CTCBrain, prepare_fsdd, ["data_folder", "save_folder", "train_takes_limit"],
               word_pipeline, "CER")
