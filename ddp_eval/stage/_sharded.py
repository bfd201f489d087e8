"""One sharded VALID/TEST stage on this rank, from its start to its merge.

A :class:`ShardedStage` is created by :class:`ddp_eval.DDPEvalMixin` when a
sharded stage starts and dropped once ``on_stage_end`` has run on every rank:

1. :meth:`ShardedStage.start` (collective): builds the stage's batch plan,
   starts recording metric objects, Brain attributes, per-batch files and
   the state outside the Brain, and in one exchange checks the plans agree
   and learns from rank 0 which batches a journal already holds; then
   broadcasts DDP buffers.
2. :meth:`ShardedStage.after_batch`: after every batch this rank evaluates,
   notes the loss and what the batch changed (and journals it when due).
3. :meth:`ShardedStage.finish` (collective): one exchange of what every rank
   holds, then the loss reduced and every rank's changes gathered, merged and
   applied, so ``on_stage_end`` sees what one process would hold; what could
   not be merged is named (:mod:`ddp_eval.stage._report`).
4. :meth:`ShardedStage.close`: removes the stage's journal.
"""

import gc
import logging
import os
import pickle
import shutil
import sys
import types
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from ddp_eval import distributed as dist
from ddp_eval import sb_compat
from ddp_eval.distributed import fsdp
from ddp_eval.errors import VerificationError
from ddp_eval.stage._draws import IN_WORKERS
from ddp_eval.stage._effects import AppendWatch, StageOutputs, write_outputs
from ddp_eval.stage._loop import LoopWatch, noted_loss, stage_loss
from ddp_eval.stage._model import ModuleUse, ddp_wrapped, model_modules, module_states
from ddp_eval.stage._report import StageReport
from ddp_eval.stage._resume import StageResume, model_of
from ddp_eval.stage._verify import StageVerifier, compare, recipe_attributes, scratch_folder, wants_verification
from ddp_eval.stage.sharding import check_same_batches, describe_loader, global_batch_ids, is_stream, new_plan
from ddp_eval.state import Fingerprint, changed_outside, in_global_order, outside_markers
from ddp_eval.state.attribute_merge import last_candidates
from ddp_eval.state.bookkeeping import StageBook, merge_stage, with_journal_notes

logger = logging.getLogger(__name__)


@contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _outside_markers(brain: Any, book: StageBook):
    """State outside the Brain (hparams, recoverables), minus what the Brain
    itself holds as mergeable attributes and the metric objects found."""
    own = [id(v) for v in vars(brain).values() if isinstance(v, (list, dict, torch.Tensor))] + [
        id(original) for original, _, _ in book.attributes.notes.copies.values()]  # a global holding one
    own += list(book.metric_object_ids())  # in hparams: merged as metric objects
    return outside_markers(brain, skip_ids=own)


class ShardedStage:
    """The bookkeeping of one sharded stage on this rank.

    Arguments
    ---------
    brain : DDPEvalMixin
        The Brain (its ``ddp_eval_config``, metric objects and attributes).
    stage : sb.Stage
        VALID or TEST.
    epoch : int, optional
        As passed to ``on_stage_start``.
    loader : DataLoader
        The sharded loader of the stage.
    journal_root : path, optional
        Where evaluation journals live (None: not journaled).
    """

    def __init__(self, brain: Any, stage: Any, epoch: Optional[int], loader: Any, journal_root=None) -> None:
        self.brain, self.stage, self.epoch, self.loader = brain, stage, epoch, loader
        self.config = brain.ddp_eval_config
        # by_dataset positions differ per rank: such a stage is not journaled
        self.journal_root = None if is_stream(loader) and loader.split == "by_dataset" else journal_root
        self.book: Optional[StageBook] = None  # what this rank's batches do to the recipe's state
        self.outputs, self.appends = StageOutputs(dist.get_rank()), AppendWatch()
        self.outside: Dict[str, Any] = {}
        self.modules: Dict[str, Dict[str, int]] = {}
        self.module_use: Optional[ModuleUse] = None  # which modules the stage's batches called (used_modules)
        self.used_modules: List[str] = []
        self.resume: Optional[StageResume] = None
        self.running = False  # between start() and finish(): batches are being evaluated
        self.local_collectives = sb_compat.local_collectives()
        self.losses: List[Optional[float]] = []  # per batch, in this rank's order; None: not finite
        self.verifier: Optional[StageVerifier] = None  # verify: the one-process reference of this stage
        self.scratch: Optional[str] = None  # where stage_output files go during the reference pass
        self.gathered: list = []  # FSDP modules whose full parameters this stage holds
        self.loop: Optional[LoopWatch] = None  # brain.step as one process counts it; random draws

    # -- start -------------------------------------------------------------------

    def start(self) -> None:
        """Collective: plan, recorders, the stage-start exchange, DDP buffers."""
        cfg, brain = self.config, self.brain
        sharded = fsdp.fsdp_modules(m for _, m in model_modules(brain))
        if sharded:  # FSDP: full parameters for the whole stage, so that its forwards wait for no other rank
            dist.decide(f"{self.stage.name} FSDP parameters gather")
            self.gathered = fsdp.gather_parameters(sharded)
        verified = brain.__dict__.setdefault("_ddp_verified", set())
        if wants_verification(cfg.verify, self.stage.name, verified) and not is_stream(self.loader):
            self.verifier = StageVerifier(brain, recipe_attributes(brain, cfg))  # before probes and factories
        self.book = StageBook(brain, cfg, share=False)
        crcs: Dict[int, int] = {}  # the buffers' checksums, read once for both uses
        tensors = model_of(brain) if self.journal_root is not None else []
        self.outside, self.modules = _outside_markers(brain, self.book), module_states(brain, crcs)
        self.book.share()  # after the markers: they see what the recipe's places hold, not the recording copies
        plan, old = None, []
        limit = brain.debug_batches if getattr(brain, "debug", False) else None  # --debug: global batches

        def local():  # the plan on every rank; the journal's answer on rank 0; shares of the model fingerprint
            nonlocal plan, old
            plan = new_plan(self.loader, limit)
            proposal, share = None, None
            if self.journal_root is not None:
                share = StageResume.share(tensors, crcs)
                if dist.get_rank() == 0:
                    *proposal, old = StageResume.propose(brain, self, self.journal_root, tensors, crcs)
            return plan.ledger.summary() if plan else None, proposal, share

        per_rank = dist.decide(f"{self.stage.name} stage start", local)
        if plan is not None:
            check_same_batches(describe_loader(self.loader, self.stage.name), [p[0] for p in per_rank], plan.ledger)
        dist.broadcast_ddp_buffers(list(brain.modules.values()))
        if dist.get_rank() > 0:  # the broadcast changed DDP buffers here (rank 0 was its source): read them anew
            self.modules.update(module_states(brain, only=ddp_wrapped(brain)))
        if self.journal_root is not None:
            self.resume = StageResume.accept(per_rank[0][1], old, tensors, [p[2] for p in per_rank], self,
                                             self.journal_root, cfg.resume_eval_every_s)
        self.loop = LoopWatch(brain, self.loader, plan)
        self.running = True
        self.module_use = ModuleUse(brain)
        self.appends.__enter__()
        self.local_collectives.__enter__()
        self.book.start()

    @property
    def metrics(self) -> Any:  # read by the journal (ddp_eval.stage._resume.StageRecord)
        return self.book.metrics

    @property
    def attributes(self) -> Any:
        return self.book.attributes

    # -- per batch -----------------------------------------------------------------

    def after_batch(self, loss: Any) -> None:
        """Notes the batch's loss and what it changed; journals when due."""
        self.losses.append(noted_loss(loss, self.brain))
        batch = self.metrics.batches
        self.book.observe()
        self.outputs.after_batch(batch)
        if self.resume is not None:
            self.resume.after_batch(self.brain, self)  # plain values: no probes in a journal piece
        self.book.start()  # probes for the next batch
        self.loop.after_batch()

    def stage_output(self, path: Any) -> Any:
        """This rank's part of a per-batch file while batches run (a scratch file
        during a verification's reference pass); ``path`` otherwise."""
        if self.scratch is not None:
            return os.path.join(self.scratch, os.path.basename(os.fspath(path)))
        return self.outputs.part(path) if self.running else path

    # -- end ------------------------------------------------------------------------

    def finish(self, local_loss: float) -> float:
        """Collective: the global stage loss, with metrics, attributes and per-batch
        files merged; what could not be is named."""
        self._stop_batches()
        resumed = self.resume is not None and self.resume.done
        if dist.get_world_size() == 1 and not resumed:
            self._finish_alone()
            loss = local_loss  # one process that evaluated everything itself: nothing to merge
        else:
            with _gc_paused():  # the merge makes and drops many small objects: no full collection in between
                loss = self._merge_all(local_loss)
        try:
            if self.verifier is not None:
                self._verify(loss)
        finally:
            self._release_parameters()
        if self.stage.name == "TEST":  # evaluate() leaves its count for on_stage_end (fit() sets 0 for VALID)
            self.loop.steps.at_test_end()
        return loss

    def _release_parameters(self) -> None:
        """FSDP modules sharded again (local), before on_stage_end (a save reads shards)."""
        gathered, self.gathered = self.gathered, []
        fsdp.release_parameters(gathered)

    def _verify(self, loss: float) -> None:
        """verify: every rank evaluates the whole stage as one process would, from
        the stage-start copy, and compares it with what on_stage_end will see."""
        brain, name = self.brain, self.stage.name
        brain._ddp_verified.add(name)

        def local():
            plan = self.loader.batch_sampler.plan
            batches = DataLoader(self.loader.dataset, batch_sampler=[plan[i] for i in range(len(plan))],
                                 collate_fn=self.loader.collate_fn)
            self.scratch = scratch_folder()
            try:
                with sb_compat.local_collectives():
                    reference_loss, reference, changed = self.verifier.reference(
                        brain, self.stage, batches,
                        lambda: {**_outside_markers(brain, self.book), **module_states(brain), **recipe_globals(brain)})
            finally:
                shutil.rmtree(self.scratch, ignore_errors=True)
                self.scratch = None
            merged = {n: getattr(brain, n, None) for n in reference}
            count, differences, uncompared = compare(loss, reference_loss, merged, reference)
            return count, differences, changed, {**self.verifier.uncopied, **uncompared}

        per_rank = dist.decide(f"{name} verify", local)
        report_verification(name, per_rank, self.config.verify == "strict")

    def _merge_all(self, local_loss: float) -> float:
        collected: Dict[str, Any] = {}
        per_rank = dist.decide(f"{self.stage.name} stage end", lambda: self._collect(collected))
        report = StageReport(self.stage.name, per_rank, self.config.on_unmergeable_attribute)
        if report.stream_read[0] is not None:  # a stream's batches are known once read: checked here
            check_same_batches(describe_loader(self.loader, self.stage.name), report.stream_read,
                               self.loader.ledger)
        report.raise_or_warn()
        record = collected["record"]
        won = {path: blob for path, blob in record.bound.items() if report.winners.get(path) == dist.get_rank()}
        gathered = dist.all_gather_bytes(collected["packed"], pickle.dumps(won))  # the state is not copied again
        states = [pickle.loads(state) for state, _ in gathered]
        pieces = [piece for *_, old in states for piece in old]  # rank 0 sent them
        loss = stage_loss([pair for state in states for pair in state[2]], self.brain, self.loop.steps.start)
        merged = merge_stage([s[0] for s in states] + [(p[0], p[1]) for p in pieces], per_rank)
        # after the last collective: a failure on this rank alone meets the others at on_stage_end's exchange
        self.book.apply(merged, report.layouts, report.winners, [pickle.loads(w) for _, w in gathered],
                        dist.get_rank(), self.stage.name)
        report.conflicts(merged.attributes.conflicts, merged.attributes.assumed)
        self._write_outputs([s[1] for s in states] + [p[2] for p in pieces])
        self.outputs.remove_parts()
        report.warn_effects()
        return loss

    def _collect(self, collected: Dict[str, Any]) -> Dict[str, Any]:
        """Everything that can fail on one rank, before the exchange: this rank's
        record (kept in ``collected``) and what travels in the exchange."""
        positions = global_batch_ids(self.loader)
        record = self.book.collect(positions)
        excluded = set(self.config.attributes_exclude) | set(self.attributes.tracks)
        now = _outside_markers(self.brain, self.book)
        outside = {label: why for label, why in changed_outside(self.outside, now).items() if label not in excluded}
        old = self.resume.old_states() if self.resume is not None else []
        places = list(positions[: self.metrics.batches]) + [float("inf")]
        losses = list(zip(positions, self.losses)) + (self.resume.old_losses() if self.resume is not None else [])
        collected.update(packed=pickle.dumps((record.state, self.outputs.state(places), losses, old)), record=record)
        notes = self.resume.old_notes() if self.resume is not None else []
        drew = [generator for generator in self.loop.draws.finish()
                if generator.replace(IN_WORKERS, "") not in excluded]
        workers = self.loop.draws.workers  # a stream read whole: its workers' seeds tell whether they drew the same
        seeds = workers.seeds.tolist() if workers is not None and self.loop.whole else None
        return {**with_journal_notes(record.report, notes), "outside": outside, "random": drew, "seeds": seeds,
                "stream": self.loader.ledger.summary() if self.loop.whole else None,  # a stream read whole
                "observed": (len(positions), len(self.losses)),
                "piece_last": [last_candidates(piece[1]) for piece in old],
                "modules": (self.modules, module_states(self.brain), self.used_modules),
                "appends": list(self.appends.paths)}

    def _write_outputs(self, parts: List[Dict[str, Any]]) -> None:
        """Rank 0 appends every rank's (and piece's) per-batch file parts in global order."""
        outputs: Dict[str, list] = {}
        for part in parts:
            for target, chunks in part.items():
                outputs.setdefault(target, []).append(chunks)
        if dist.get_rank() == 0:
            write_outputs({target: in_global_order(chunks) for target, chunks in outputs.items()})

    def _finish_alone(self) -> None:
        """One process: probes out, its own per-batch files appended to their targets."""
        self.book.finish_alone(global_batch_ids(self.loader))
        places = list(global_batch_ids(self.loader)) + [float("inf")]
        write_outputs({t: in_global_order([c]) for t, c in self.outputs.state(places).items()})
        self.outputs.remove_parts()

    def _stop_batches(self) -> None:
        if self.running:
            self.running = False
            self.loop.stop()
            self.used_modules = self.module_use.stop()
            self.appends.__exit__()
            self.local_collectives.__exit__(None, None, None)

    def abandon(self) -> None:
        """The stage ended by an exception: the user's objects get back their plain
        numbers and factories, and this rank's part files are removed."""
        self._stop_batches()
        self._release_parameters()
        if self.book is not None:
            self.book.release()
        self.outputs.remove_parts()

    def close(self) -> None:
        """After ``on_stage_end`` ran on every rank: the journal is no longer needed."""
        if self.resume is not None:
            self.resume.close()


def recipe_globals(brain: Any) -> Dict[str, int]:
    """``{global NAME: fingerprint}`` of the module-level values of the recipe's script
    (not modules, classes or functions): what a reference pass may change outside the Brain."""
    module = sys.modules.get(type(brain).__module__)
    found = {}
    for name, value in list(vars(module).items()) if module is not None else []:
        if name.startswith("__") or callable(value) or isinstance(value, types.ModuleType):
            continue
        found[f"global {name}"] = Fingerprint.of(value, depth=2).digest
    return found


def report_verification(stage: str, per_rank: List[Tuple[int, list, dict, dict]], strict: bool) -> None:
    """The verdict of a verified stage, the same on every rank: one info line, or
    each difference by path with both values (an error on every rank if ``strict``)."""
    count = per_rank[0][0]
    differing = [(rank, diffs) for rank, (_, diffs, _, _) in enumerate(per_rank) if diffs]
    notes = [f"{label} ({why})" for label, why in {**per_rank[0][2], **per_rank[0][3]}.items()]
    if not differing:
        if dist.get_rank() == 0:
            logger.info(f"ddp_eval: {stage} verified: {count} values equal one process.")
            if notes:
                logger.warning(f"ddp_eval: {stage} verification: not compared, or run twice by the reference pass "
                               f"(state outside the Brain, or values that cannot be copied): {'; '.join(notes)}.")
        return
    shown = []
    for rank, diffs in differing:
        for path, got, want in diffs[:20]:
            shown.append(f"rank {rank}: {path}: on_stage_end would see {got}, one process {want}")
    message = (f"ddp_eval: {stage} verification: {sum(len(d) for _, d in differing)} value(s) differ from one "
               f"process (of {count} compared): " + "; ".join(shown) + ". Expected every value to equal one "
               "process. Compute such a value in on_stage_end from merged state, or list it in ddp_eval: "
               "attributes_exclude, or evaluate the stage unsharded (shard_valid/shard_test: false); "
               "docs/exactness.md lists what is merged.")
    if notes:
        message += f" Also not compared, or run twice by the reference pass: {'; '.join(notes)}."
    if strict:
        raise VerificationError(message)
    if dist.get_rank() == 0:
        logger.warning(message)


