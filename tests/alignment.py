"""A Brain written like SpeechBrain's ASR_alignment_viterbi integration example.

An ``HMMAligner`` in the hparams keeps the Viterbi alignments it computes in
``self.hparams.aligner.align_dict``: stored in ``compute_objectives`` of every
evaluation stage, read back by ``get_prev_alignments`` for the loss of every
stage, and refreshed for the training set by a nested ``evaluate(train_data)``
in VALID's ``on_stage_end``. That state lives outside the Brain. The data are
generated (12 training and 3 validation "utterances" of 8-dim frames, phoneme
sequences of 3-5 of 6 labels); lr 0 keeps the model fixed, so one process
and N processes evaluate the same model.
"""

import speechbrain as sb
import torch
from speechbrain.alignment.aligner import HMMAligner

import ddp_eval

LABELS, FEATS = 6, 8


def make_set(n, seed, prefix):
    g = torch.Generator().manual_seed(seed)
    data = {}
    for i in range(n):
        frames = int(torch.randint(12, 24, (1,), generator=g))
        data[f"{prefix}{i:02d}"] = {
            "feats": torch.randn(frames, FEATS, generator=g).tolist(),
            "phns": torch.randint(0, LABELS, (int(torch.randint(3, 6, (1,), generator=g)),),
                                  generator=g).tolist()}
    ds = sb.dataio.dataset.DynamicItemDataset(data)

    @sb.utils.data_pipeline.takes("feats", "phns")
    @sb.utils.data_pipeline.provides("feats_t", "phn_encoded")
    def pipeline(feats, phns):
        yield torch.tensor(feats)
        yield torch.tensor(phns)

    ds.add_dynamic_item(pipeline)
    ds.set_output_keys(["id", "feats_t", "phn_encoded"])
    return ds


class AlignBrain(sb.Brain):
    def compute_forward(self, batch, stage):
        feats, lens = batch.feats_t
        return self.modules.model(feats).log_softmax(-1), lens

    def compute_objectives(self, predictions, batch, stage):
        predictions, lens = predictions
        phns, phn_lens = batch.phn_encoded
        prev_alignments = self.hparams.aligner.get_prev_alignments(batch.id, predictions, lens, phns, phn_lens)
        loss = sb.nnet.losses.nll_loss(predictions, prev_alignments)
        if stage != sb.Stage.TRAIN:
            _, alignments = self.hparams.aligner(predictions, lens, phns, phn_lens, "viterbi")
            self.hparams.aligner.store_alignments(batch.id, alignments)
        return loss

    def on_stage_end(self, stage, stage_loss, epoch=None):
        self.losses.append((stage.name, epoch, stage_loss))
        if stage == sb.Stage.VALID:
            self.evaluate(self.hparams.train_data)  # recalculate the training alignments


def run(brain_cls, ddp_eval_opts=None, epochs=2):
    """fit (12 training, 3 validation utterances, batch 1), then evaluate the
    validation set; returns the stage losses and the alignments."""
    torch.manual_seed(3)
    train, valid = make_set(12, 0, "trn"), make_set(3, 1, "dev")
    hparams = {"aligner": HMMAligner(), "train_data": train}
    if ddp_eval_opts is not None:
        hparams["ddp_eval"] = ddp_eval_opts
    brain = brain_cls(modules={"model": torch.nn.Linear(FEATS, LABELS)},
                      opt_class=lambda p: torch.optim.Adam(p, lr=0.0), hparams=hparams,
                      run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo"})
    brain.losses = []
    kwargs = {"batch_size": 1}
    brain.fit(range(epochs), train, valid, train_loader_kwargs=kwargs, valid_loader_kwargs=kwargs)
    brain.evaluate(valid, test_loader_kwargs=kwargs)
    return {"losses": brain.losses,
            "align_dict": [(k, v.tolist()) for k, v in brain.hparams.aligner.align_dict.items()]}


class DDPAlignBrain(ddp_eval.DDPEvalMixin, AlignBrain):
    pass
