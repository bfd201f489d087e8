"""What resume will load, and why: ``python -m ddp_eval.inspect CHECKPOINT_DIR``.

Lists every entry of a checkpoints folder (written by ddp_eval or by
SpeechBrain's own Checkpointer) with its status, complete or skipped and why,
its meta, size and end-of-epoch flag, and names the checkpoint that
``recover_if_possible`` would load for the given key. The choice is made by
:class:`ddp_eval.Checkpointer` itself, so it is the one resume makes. It also
lists the evaluation journals (``resume_eval``): stage, epoch, batches done.

    python -m ddp_eval.inspect results/demo/1986/save --min-key error_rate
    python -m ddp_eval.inspect save/ --verify --json

Options: ``--min-key K`` / ``--max-key K`` (as ``recover_if_possible``),
``--verify`` (also check sha256 where recorded), ``--require a,b`` (the
recoverables a checkpoint must hold; default: inferred from the folder),
``--journal DIR`` (journals elsewhere than ``FOLDER/.ddp_eval-journal``), ``--json``.

Example
-------
>>> import torch, ddp_eval
>>> folder = getfixture("tmp_path")
>>> _ = ddp_eval.Checkpointer(folder, {"model": torch.nn.Linear(2, 2)}).save_checkpoint(meta={"wer": 3.0})
>>> report = describe_folder(folder, min_key="wer")
>>> [(c["status"], c["writer"]) for c in report["checkpoints"]], report["would_load"] is not None
([('complete', 'ddp_eval')], True)
"""

import argparse
import json
import logging
import pathlib
import sys
from typing import Any, Dict, List, Optional, Sequence

from speechbrain.utils import checkpoints as sb_ckpt

from ddp_eval.checkpointing.commit import MANIFEST_KEY, TMP_PREFIX, TRASH_PREFIX, inspect_checkpoint_dir, read_meta
from ddp_eval.distributed.dcp import SUFFIX as SHARDED_SUFFIX
from ddp_eval.stage import JOURNAL_DIRNAME, describe_journals

_LEFTOVERS = {
    TMP_PREFIX: "temporary directory: a save in progress, or the leftover of a crash; never "
                "loaded, removed by the writer at the next start",
    TRASH_PREFIX: "leftover of a crash while replacing or deleting a checkpoint; repaired or "
                  "removed by the writer at the next start",
}


def _size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _infer_required(folder: pathlib.Path) -> List[str]:
    """Parameter files every checkpoint should hold: those in ddp_eval manifests,
    else those of any checkpoint in the folder."""
    manifests, seen = set(), set()
    for path in folder.glob(f"{sb_ckpt.CKPT_PREFIX}*"):
        _, meta = read_meta(path)
        for name in meta.get(MANIFEST_KEY) or {}:
            top = name.split("/")[0]  # a sharded recoverable's files lie in <name>.dcp/
            if top.endswith((sb_ckpt.PARAMFILE_EXT, SHARDED_SUFFIX)):
                manifests.add(top.rsplit(".", 1)[0])
        seen.update(f.stem for f in path.glob(f"*{sb_ckpt.PARAMFILE_EXT}"))
    return sorted(manifests or seen)


def _entry(path: pathlib.Path, required: Sequence[str], verify: bool) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"name": path.name, "size_bytes": _size(path) if path.is_dir() else None}
    for prefix, why in _LEFTOVERS.items():
        if path.name.startswith(prefix):
            return {**entry, "status": "skipped", "reason": why, "writer": None, "meta": {}}
    if not (path / sb_ckpt.METAFNAME).exists():
        return {**entry, "status": "skipped", "writer": None, "meta": {},
                "reason": f"meta file {sb_ckpt.METAFNAME} missing: not a checkpoint (a save that never finished)"}
    problem, meta = inspect_checkpoint_dir(path, verify, required)
    return {**entry, "status": "skipped" if problem else "complete", "reason": problem,
            "writer": "ddp_eval" if MANIFEST_KEY in meta else "SpeechBrain (no manifest)",
            "end_of_epoch": meta.get("end-of-epoch"),
            "meta": {k: v for k, v in meta.items() if k != MANIFEST_KEY}}


def describe_folder(folder, min_key: Optional[str] = None, max_key: Optional[str] = None,
                    verify: bool = False, required: Optional[Sequence[str]] = None,
                    journal_root=None) -> Dict[str, Any]:
    """Everything ``python -m ddp_eval.inspect`` reports, as a dict."""
    from ddp_eval.checkpointing.checkpoint import Checkpointer  # the choice resume makes

    folder = pathlib.Path(folder)
    inferred = required is None
    required = _infer_required(folder) if inferred else list(required)
    entries = sorted((p for p in folder.iterdir() if p.is_dir() and (
        p.name.startswith(sb_ckpt.CKPT_PREFIX) or any(p.name.startswith(x) for x in _LEFTOVERS))),
        key=lambda p: p.name)
    checkpoints = [_entry(p, required, verify) for p in entries]
    quiet = logging.getLogger("ddp_eval")
    level, quiet.level = quiet.level, logging.ERROR  # the statuses say it already
    try:
        chooser = Checkpointer(folder, recoverables={name: None for name in required}, checksums=verify)
        chosen = chooser.find_checkpoint(min_key=min_key, max_key=max_key)
    finally:
        quiet.level = level
    return {"folder": str(folder), "required": required, "required_inferred": inferred,
            "keys": {"min_key": min_key, "max_key": max_key},
            "checkpoints": checkpoints, "would_load": chosen.path.name if chosen else None,
            "journals": describe_journals(journal_root or folder / JOURNAL_DIRNAME)}


def _human(size: Optional[int]) -> str:
    if size is None:
        return ""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def format_report(report: Dict[str, Any]) -> str:
    """The report as text, one line per entry."""
    lines = [f"Checkpoints folder {report['folder']}: {len(report['checkpoints'])} entries; required "
             f"files: {', '.join(report['required']) or 'none'}"
             + (" (inferred; set --require)" if report["required_inferred"] else "")]
    for c in report["checkpoints"]:
        if c["status"] == "complete":
            kind = "end-of-epoch" if c["end_of_epoch"] else "intra-epoch"
            meta = ", ".join(f"{k}={v}" for k, v in c["meta"].items() if k not in ("unixtime", "end-of-epoch"))
            lines.append(f"  {c['name']}  complete  {kind}  {_human(c['size_bytes'])}  written by "
                         f"{c['writer']}" + (f"  {meta}" if meta else ""))
        else:
            lines.append(f"  {c['name']}  skipped: {c['reason']}")
    keys = ", ".join(f"{k}={v!r}" for k, v in report["keys"].items() if v is not None)
    lines.append(f"recover_if_possible({keys}) would load: {report['would_load'] or 'nothing (no match)'}")
    for j in report["journals"]:
        total = j["batches"] if j["batches"] is not None else "? (a stream)"
        done = "; ".join(f"model {m}: {n} of {total} batches done" for m, n in j["done_by_model"].items())
        lines.append(f"evaluation journal {j['folder']}: {j['stage']}, epoch {j['epoch']}, {j['pieces']} piece(s); "
                     f"{done or 'nothing readable'}; checkpoint(s) {', '.join(j['checkpoints']) or '-'}"
                     + (f"; damaged: {', '.join(j['damaged'])}" if j["damaged"] else ""))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_eval.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path, help="the checkpoints folder (e.g. results/.../save)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--min-key", help="as recover_if_possible(min_key=...)")
    keys.add_argument("--max-key", help="as recover_if_possible(max_key=...)")
    parser.add_argument("--verify", action="store_true", help="also verify sha256 checksums where recorded")
    parser.add_argument("--require", help="comma-separated recoverables every checkpoint must hold")
    parser.add_argument("--journal", type=pathlib.Path, help="evaluation journals folder (default: "
                        f"FOLDER/{JOURNAL_DIRNAME})")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"ddp_eval.inspect: {args.folder} is not a directory; expected a checkpoints folder "
              "(the checkpointer's checkpoints_dir).", file=sys.stderr)
        return 2
    required = [r for r in args.require.split(",") if r] if args.require is not None else None
    report = describe_folder(args.folder, args.min_key, args.max_key, args.verify, required, args.journal)
    print(json.dumps(report, indent=1, default=str) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
