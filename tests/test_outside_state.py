"""State a sharded stage writes outside the Brain: named in a warning, merged when
listed (SpeechBrain's ASR_alignment_viterbi shape, real gloo groups)."""

import logging
import math
import types

import pytest
import speechbrain as sb

from tests import alignment, toy
from tests.mp_harness import results, run_ranks
from tests.workers import GLOBAL_IDS, GlobalState, alignment_example, global_state

pytestmark = pytest.mark.timeout(180)
PATH = "hparams.aligner.align_dict"


@pytest.fixture(scope="module")
def single_process():
    return alignment.run(alignment.AlignBrain)


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_unlisted_outside_state_is_named_in_a_warning(world_size):
    per_rank = results(run_ranks(alignment_example, world_size, None, timeout=150))
    warnings = per_rank[0]["warnings"]
    named = [w for w in warnings if f"'{PATH}'" in w]
    assert named and all("state outside the Brain" in w and "attributes_include" in w for w in named)
    assert "dict gained" in named[0]  # the first VALID stage added its utterances
    assert all(out["warnings"] == [] for out in per_rank[1:])  # logged once, on rank 0
    # what it warns about: each rank holds only some of the 15 alignments
    assert all(len(out["align_dict"]) < 15 for out in per_rank)


@pytest.mark.parametrize("world_size", [2, 3])
def test_listed_outside_state_is_merged_and_equals_one_process(world_size, single_process):
    per_rank = results(run_ranks(alignment_example, world_size, {"attributes_include": [PATH]},
                                 timeout=150))
    want = single_process
    for out in per_rank:
        assert out["warnings"] == []
        assert out["align_dict"] == want["align_dict"]  # keys in one process's order, values
        assert [s[:2] for s in out["losses"]] == [s[:2] for s in want["losses"]]
        for got, exp in zip(out["losses"], want["losses"]):
            # TRAIN of epoch 1 reads the training alignments the nested evaluate() stored
            assert math.isclose(got[2], exp[2], rel_tol=1e-9), (got, exp)


@pytest.mark.fast
def test_a_beam_searchers_scratch_state_is_not_named_but_an_aligners_dict_is():
    """SpeechBrain's S2S beam searchers rewrite batch_size, n_bh, beam_offset and
    max_decode_steps on every call: no warning for them (every seq2seq recipe keeps
    its searchers in hparams); an HMMAligner's dict growing in place is named."""
    import types

    import speechbrain as sb
    import torch
    from speechbrain.alignment.aligner import HMMAligner
    from speechbrain.decoders.seq2seq import S2SRNNBeamSearcher
    from speechbrain.nnet.RNN import AttentionalRNNDecoder

    from ddp_eval.state._outside import changed_outside, outside_markers

    torch.manual_seed(0)
    searcher = S2SRNNBeamSearcher(
        sb.nnet.embedding.Embedding(num_embeddings=5, embedding_dim=3),
        AttentionalRNNDecoder("gru", "content", hidden_size=3, attn_dim=3, num_layers=1, enc_dim=4, input_size=3),
        sb.nnet.linear.Linear(input_size=3, n_neurons=5),
        bos_index=0, eos_index=1, min_decode_ratio=0.0, max_decode_ratio=1.0, beam_size=2)
    aligner = HMMAligner()
    brain = types.SimpleNamespace(hparams=types.SimpleNamespace(valid_search=searcher, aligner=aligner))
    searcher(torch.randn(3, 6, 4), torch.ones(3))  # an earlier stage used it
    start = outside_markers(brain)
    searcher(torch.randn(2, 9, 4), torch.ones(2))  # this stage's last, smaller batch
    aligner.align_dict["utt1"] = torch.zeros(3)
    assert searcher.batch_size == 2  # its scratch did change
    assert changed_outside(start, outside_markers(brain)) == {
        PATH: "dict gained 1 key(s) (0 -> 1)"}


@pytest.mark.fast
def test_a_beam_searcher_that_decoded_other_batch_sizes_is_not_a_module_apart():
    """The module check (stage start and end, across ranks) reads a decoder's buffers,
    not the batch_size and n_bh each call rewrites: two ranks whose last batches
    differed in size hold the same searcher; a changed parameter or buffer still counts."""
    import types

    import speechbrain as sb
    import torch
    from speechbrain.decoders.seq2seq import S2SRNNBeamSearcher
    from speechbrain.nnet.RNN import AttentionalRNNDecoder

    from ddp_eval.stage._model import differing_modules, module_states

    def rank(batch_size):
        torch.manual_seed(0)
        searcher = S2SRNNBeamSearcher(
            sb.nnet.embedding.Embedding(num_embeddings=5, embedding_dim=3),
            AttentionalRNNDecoder("gru", "content", hidden_size=3, attn_dim=3, num_layers=1, enc_dim=4,
                                  input_size=3),
            sb.nnet.linear.Linear(input_size=3, n_neurons=5),
            bos_index=0, eos_index=1, min_decode_ratio=0.0, max_decode_ratio=1.0, beam_size=2)
        searcher(torch.randn(batch_size, 6, 4), torch.ones(batch_size))
        searcher.register_buffer("calls", torch.zeros(1))
        return types.SimpleNamespace(hparams=types.SimpleNamespace(valid_search=searcher))

    brains = [rank(3), rank(2)]
    assert brains[0].hparams.valid_search.batch_size != brains[1].hparams.valid_search.batch_size
    states = [module_states(b) for b in brains]
    assert differing_modules(states, states) == {}
    brains[1].hparams.valid_search.calls += 1  # a buffer apart
    apart = [module_states(b) for b in brains]
    assert list(differing_modules(apart, apart)) == ["hparams.valid_search"]


@pytest.mark.fast
def test_what_a_recipe_object_or_a_container_in_hparams_holds_deeper_is_seen():
    """Below what lengths and identities show: an entry's list grown in place, a
    counter two fields down, a string field; a library's object (a logger) and a
    module changing as they work are not named."""
    import logging
    import types

    import torch

    from ddp_eval.state._outside import changed_outside, outside_markers

    tracker = types.SimpleNamespace(inner=types.SimpleNamespace(n=0), name="start")
    table = {"utt1": [0]}
    brain = types.SimpleNamespace(hparams=types.SimpleNamespace(
        tracker=tracker, table=table, log=logging.getLogger("x"), model=torch.nn.Linear(2, 2), lr=0.1))
    start = outside_markers(brain)
    assert changed_outside(start, outside_markers(brain)) == {}
    brain.hparams.log.disabled = True  # a library's object: as it works
    brain.hparams.model.weight.data += 1  # a module: its state is checked apart
    assert changed_outside(start, outside_markers(brain)) == {}
    tracker.inner.n += 1
    table["utt1"].append(1)
    changed = changed_outside(start, outside_markers(brain))
    assert set(changed) == {"hparams.tracker.inner", "hparams.table"}, changed
    assert "what it holds changed" in changed["hparams.table"]
    tracker.name = "end"
    assert changed_outside(start, outside_markers(brain))["hparams.tracker.name"] == "value changed ('start' -> 'end')"


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_a_global_and_a_class_attribute_batches_change_are_named(world_size, tmp_path):
    """A recipe that accumulates into a global of its module and into a dict held by
    its Brain class: each rank holds only its own batches' share, so both are named
    in a warning, with how to keep them on the Brain."""
    GLOBAL_IDS.clear()
    GlobalState.per_class = {}
    single = toy.run_accumulating(toy.build(GlobalState, tmp_path / "plain", epochs=1,
                                            checkpointer_cls=sb.utils.checkpoints.Checkpointer))
    per_rank = results(run_ranks(global_state, world_size, str(tmp_path / "ddp"), None, timeout=150))
    valid = [w for w in per_rank[0]["warnings"] if "VALID" in w and "state outside the Brain" in w]
    assert valid and "'global GLOBAL_IDS'" in valid[0] and "'class GlobalState.per_class'" in valid[0], valid
    assert "keep it on the Brain instead" in valid[0]
    assert per_rank[0]["log"][0]["outside"] != single["log"][0]["outside"]  # the naming matters
    # TEST: 2 batches, so at 3 ranks one rank has none; its rank-local state still differs, and is named
    test = [w for w in per_rank[0]["warnings"] if "TEST" in w and "state outside the Brain" in w]
    assert test and "'global GLOBAL_IDS'" in test[0] and "'class GlobalState.per_class'" in test[0], test
    assert [out["log"][-1]["outside"] for out in per_rank] != [single["log"][-1]["outside"]] * world_size


SEEN, RATE, LOGGER = [], 0.5, logging.getLogger("recipe")


def _note(utt):  # a function of the recipe's module a batch calls: what it names is reached too
    SEEN.append(utt)


class Reaching:
    cache, threshold, scale = {}, 0.5, staticmethod(abs)

    def compute_objectives(self, predictions, batch, stage):
        LOGGER.info("batch")  # a library's object: not state of the recipe's
        _note(batch)
        return math.sqrt(RATE) * self.threshold


@pytest.mark.fast
def test_the_globals_and_class_attributes_batch_code_reaches():
    from ddp_eval.state._outside import reached_outside

    assert reached_outside(Reaching()) == {"global SEEN": SEEN, "global RATE": RATE,
                                           "class Reaching.cache": {}, "class Reaching.threshold": 0.5}


FLAG, LAST = False, None


class Flagging:
    def __init__(self):
        self.hparams = types.SimpleNamespace(n_mels=40, seen=40, done=False)

    def compute_objectives(self, predictions, batch, stage):
        global FLAG, LAST
        FLAG, LAST = FLAG or batch % 2 == 1, batch
        self.hparams.seen += 1
        self.hparams.done = True


@pytest.mark.fast
def test_bools_none_and_equal_numbers_outside_the_brain_are_each_marked():
    """A bool or None global a batch rebinds, and an ``hparams`` counter that held the
    same (interned) number as another field at stage start: each is named."""
    global FLAG, LAST
    from ddp_eval.state._outside import changed_outside, outside_markers

    brain = Flagging()
    start = outside_markers(brain)
    brain.compute_objectives(None, 3, None)
    try:
        assert set(changed_outside(start, outside_markers(brain))) == {
            "global FLAG", "global LAST", "hparams.seen", "hparams.done"}
    finally:
        FLAG, LAST = False, None
