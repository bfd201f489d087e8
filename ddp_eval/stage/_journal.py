"""Evaluation journals: an interrupted VALID/TEST stage resumes where it stopped.

During a sharded stage with ``ddp_eval: resume_eval``, every rank writes, at
most every ``resume_eval_every_s`` seconds, one journal *piece*: what the
batches it finished since its previous piece contributed (each batch's loss,
the entries they appended to metric objects, attribute increments), tagged with
their global batch positions. Each rank writes only its own pieces, each whole
or not at all (:func:`ddp_eval.checkpointing.commit.write_file_atomically`), so nothing is
synchronised per batch.

A journal belongs to one *key*: stage, epoch, the data (ids and batch
composition of the set), and the metric and attribute layout; every piece also
names the model it evaluated (a fingerprint of the parameters and buffers).
When a stage starts, :func:`find_resumable` returns the pieces of its key
written with the same model; anything else is left alone and named in one log
line saying why. Layout of a journal folder::

    <root>/<STAGE>-<epoch>-<key digest>/piece-<run>-r<rank>-<n>.pkl

Example
-------
>>> key = JournalKey("TEST", None, data="d1", batches=4, layout="l1")
>>> journal = StageJournal(getfixture("tmp_path"), key, rank=0, every_s=0.0)
>>> journal.write("model-1", [0, 2], [(0, 1.5), (2, None)], metrics={}, attributes={})
>>> pieces, notes = find_resumable(getfixture("tmp_path"), key, lambda: "model-1")
>>> [piece["positions"] for _, piece in pieces], notes
([[0, 2]], [])
"""

import dataclasses
import hashlib
import pickle
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ddp_eval.checkpointing.commit import write_file_atomically

FORMAT = 5  # 5 (0.9.1): what no merge replays (notes); 4 (0.7.0): each batch's loss; 3 (0.4.0): metric
# objects' other fields as attribute changes; 2: 0.3
JOURNAL_DIRNAME = ".ddp_eval-journal"
PIECE_PREFIX = "piece-"


@dataclasses.dataclass(frozen=True)
class JournalKey:
    """What a journal must match to be resumed (besides the model)."""

    stage: str
    epoch: Optional[int]
    data: str  # fingerprint of the ids and batch composition ("stream": checked per batch)
    batches: Optional[int]  # number of batches of the set (None: a stream)
    layout: str  # fingerprint of the metric objects and attributes merged

    def dirname(self) -> str:
        digest = hashlib.sha1(f"{self.data}/{self.batches}/{self.layout}".encode()).hexdigest()[:16]
        return f"{self.prefix()}{digest}"

    def prefix(self) -> str:
        return f"{self.stage}-{'none' if self.epoch is None else self.epoch}-"


def layout_fingerprint(metric_objects: Sequence[Tuple[str, str]], attributes: Sequence[str]) -> str:
    """A digest of the metric objects (path, class) and the attribute labels merged."""
    return hashlib.sha1(repr((list(metric_objects), sorted(attributes))).encode()).hexdigest()[:20]


class StageJournal:
    """The pieces one rank writes during one stage.

    Arguments
    ---------
    root : path
        The journals folder (e.g. ``<checkpoints_dir>/.ddp_eval-journal``).
    key : JournalKey
        The stage's key (the same on every rank).
    rank : int
        This rank (in the piece names).
    every_s : float
        Write at most every ``every_s`` seconds (0: after every batch).
    """

    def __init__(self, root, key: JournalKey, rank: int, every_s: float, fsync: bool = True) -> None:
        import pathlib

        self.folder = pathlib.Path(root) / key.dirname()
        self.key, self.rank, self.every_s, self.fsync = key, rank, every_s, fsync
        self.run = uuid.uuid4().hex[:8]
        self.written: List[Any] = []
        self._last = time.monotonic()

    def due(self) -> bool:
        """Whether the interval since the previous piece has passed."""
        return time.monotonic() - self._last >= self.every_s

    def write(self, model: str, positions: Sequence[int], loss: Sequence[Tuple[int, Optional[float]]], metrics: Any,
              attributes: Any, batch_digests: Optional[Dict[int, Optional[str]]] = None,
              checkpoint: Optional[str] = None, outputs: Optional[Dict[str, Any]] = None,
              notes: Optional[Dict[str, Any]] = None) -> None:
        """Writes one piece: the contributions of the batches at ``positions``."""
        piece = {"format": FORMAT, "key": dataclasses.asdict(self.key), "model": model, "checkpoint": checkpoint,
                 "rank": self.rank, "positions": list(positions), "batch_digests": batch_digests or {},
                 "loss": [tuple(pair) for pair in loss], "metrics": metrics, "attributes": attributes,
                 "outputs": outputs or {}, "notes": notes or {}}
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{PIECE_PREFIX}{self.run}-r{self.rank}-{len(self.written):06d}.pkl"
        write_file_atomically(path, pickle.dumps(piece, protocol=pickle.HIGHEST_PROTOCOL), self.fsync)
        self.written.append(path)
        self._last = time.monotonic()


def _describe_difference(found: Dict[str, Any], key: JournalKey) -> str:
    why = []
    if (found.get("data"), found.get("batches")) != (key.data, key.batches):
        why.append(f"its data differ ({found.get('batches')} batches, fingerprint {found.get('data')}; now "
                   f"{key.batches} batches, fingerprint {key.data}: another set, batch size or sampler)")
    if found.get("layout") != key.layout:
        why.append("its metric objects or merged attributes differ")
    return " and ".join(why) or "its key differs"


def find_resumable(root, key: JournalKey, fingerprint: Callable[[], str],
                   checkpoint: Optional[str] = None) -> Tuple[List[Tuple[Any, dict]], List[str]]:
    """Rank 0 at stage start: ``(pieces, notes)``.

    ``pieces`` are ``(path, piece)`` of ``key`` written with the model whose
    ``fingerprint()`` (called only if there are pieces) this stage has, each
    batch position once; ``notes`` are log lines about everything else found
    for this stage and epoch: journals of other data or layout, pieces of
    another model, damaged pieces (their batches are evaluated again).
    """
    import pathlib

    root, notes, pieces = pathlib.Path(root), [], []
    if not root.is_dir():
        return pieces, notes
    mine = root / key.dirname()
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(key.prefix())):
        if folder == mine:
            continue
        found = next((_read(f)[0] for f in sorted(folder.glob(f"{PIECE_PREFIX}*.pkl")) if _read(f)[0]), None)
        why = _describe_difference(found["key"], key) if found else "it holds no readable piece"
        notes.append(f"ddp_eval: not resuming {key.stage} from journal {folder}: {why}. It is left as it is; "
                     "delete it if no run will resume it.")
    files = sorted(mine.glob(f"{PIECE_PREFIX}*.pkl")) if mine.is_dir() else []
    if not files:
        return pieces, notes
    model, others, covered = fingerprint(), {}, set()
    for path in files:
        piece, problem = _read(path)
        if problem is None and piece["key"] != dataclasses.asdict(key):
            problem = "its key differs from its folder's"
        if problem is not None:
            notes.append(f"ddp_eval: skipping damaged journal piece {path} ({problem}); its batches are "
                         "evaluated again.")
            continue
        if piece["model"] != model:
            others.setdefault((piece["model"], piece.get("checkpoint")), []).append(path)
            continue
        if covered.intersection(piece["positions"]):
            notes.append(f"ddp_eval: skipping journal piece {path}: it repeats batches another piece holds.")
            continue
        covered.update(piece["positions"])
        pieces.append((path, piece))
    for (other, checkpoint_name), paths in others.items():
        notes.append(f"ddp_eval: not resuming {key.stage} from {len(paths)} journal piece(s) in {mine}: written "
                     f"with another model (fingerprint {other}, checkpoint {checkpoint_name}; now fingerprint "
                     f"{model}, checkpoint {checkpoint}). They are left as they are.")
    return pieces, notes


def _read(path) -> Tuple[Optional[dict], Optional[str]]:
    try:
        piece = pickle.loads(path.read_bytes())
    except (ModuleNotFoundError, AttributeError) as exc:  # names modules of an older layout (0.3)
        return None, (f"written by an older ddp_eval (journal format before {FORMAT}: {type(exc).__name__}: {exc}); "
                      "its batches are evaluated again")
    except Exception as exc:  # truncated or otherwise unreadable
        return None, f"{type(exc).__name__}: {exc}"
    if not isinstance(piece, dict) or piece.get("format") != FORMAT:
        return None, f"not a journal piece of format {FORMAT}"
    return piece, None


def remove_pieces(paths: Iterable[Any]) -> None:
    """Deletes pieces and, once empty, their folders (ignoring what is gone)."""
    folders = set()
    for path in paths:
        path.unlink(missing_ok=True)
        folders.add(path.parent)
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            pass  # other pieces (another model's, another rank's) remain


def describe_journals(root) -> List[Dict[str, Any]]:
    """For inspection: each journal folder's stage, epoch, models and batches done."""
    import pathlib

    out = []
    root = pathlib.Path(root)
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        pieces = [(_read(f), f) for f in sorted(folder.glob(f"{PIECE_PREFIX}*.pkl"))]
        good = [p for (p, problem), _ in pieces if problem is None]
        key = good[0]["key"] if good else {}
        models: Dict[str, set] = {}
        for piece in good:
            models.setdefault(piece["model"], set()).update(piece["positions"])
        out.append({"folder": folder.name, "stage": key.get("stage"), "epoch": key.get("epoch"),
                    "batches": key.get("batches"), "pieces": len(pieces),
                    "damaged": [f.name for (_, problem), f in pieces if problem is not None],
                    "done_by_model": {m: len(p) for m, p in models.items()},
                    "checkpoints": sorted({str(p.get("checkpoint")) for p in good})})
    return out
