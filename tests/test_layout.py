"""The package's layering (issue 27): imports go downward only. ``state`` (what a
batch did and how it merges) never issues a collective; ``checkpointing`` imports
nothing from evaluation; nothing below the top level imports the mixin."""

import ast
import pathlib

import pytest

import ddp_eval

pytestmark = pytest.mark.fast
PACKAGE = pathlib.Path(ddp_eval.__file__).parent
BASE = {"ddp_eval.errors", "ddp_eval.sb_compat"}
ALLOWED = {  # subpackage -> what its modules may import besides themselves
    "state": BASE,
    "checkpointing": BASE | {"ddp_eval.distributed", "ddp_eval.config"},
    "stage": BASE | {"ddp_eval.distributed", "ddp_eval.config", "ddp_eval.state", "ddp_eval.checkpointing"},
}


def imported(path: pathlib.Path):
    """The ddp_eval modules a file imports (``from ddp_eval import distributed as dist`` as
    ddp_eval.distributed)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddp_eval"):
            if node.module == "ddp_eval":
                found |= {f"ddp_eval.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("ddp_eval")}
    return found


def _allowed(module: str, target: str) -> bool:
    package = module.split(".")[1]
    if target.startswith(f"ddp_eval.{package}"):
        return True
    return any(target == a or target.startswith(a + ".") for a in ALLOWED[package])


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_downward_only(package):
    broken = []
    files = sorted((PACKAGE / package).glob("*.py"))
    assert files, package
    for path in files:
        module = f"ddp_eval.{package}.{path.stem}"
        broken += [f"{module} imports {target}" for target in sorted(imported(path)) if not _allowed(module, target)]
    assert not broken, "imports that break the layering (see the subpackage's docstring):\n" + "\n".join(broken)


def test_the_check_sees_a_broken_import(tmp_path):
    """The check itself can fail: a state module importing distributed is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ddp_eval import distributed as dist\nfrom ddp_eval.state._values import ABSENT\n")
    assert {t for t in imported(bad) if not _allowed("ddp_eval.state.bad", t)} == {"ddp_eval.distributed"}


def test_only_the_distributed_package_touches_torch_distributed():
    """One package owns every torch.distributed call (the guide): ``distributed`` (the
    control plane and collectives), with FSDP and DCP in modules of their own; SpeechBrain's own
    distributed helpers are reached through sb_compat."""
    def touches(path):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                return True
            if isinstance(node, ast.Attribute) and node.attr == "distributed" and (
                    getattr(node.value, "id", "") == "torch"):
                return True
        return False

    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if p.relative_to(PACKAGE).parts[0] != "distributed" and touches(p))
    assert users == [], users


def test_every_module_but_the_public_ones_is_marked_private():
    public = {"__init__", "attribute_merge", "metrics", "metric_merge", "bookkeeping", "sharding", "commit",
              "checkpoint"}
    for package in ALLOWED:
        for path in (PACKAGE / package).glob("*.py"):
            assert path.stem in public or path.stem.startswith("_"), path


def test_private_modules_are_imported_only_inside_their_subpackage():
    """A module whose name starts with ``_`` is its subpackage's own: others import
    what the subpackage makes public (its ``__init__`` or modules without ``_``)."""
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        here = parts[0] if len(parts) > 1 else None  # a top-level module belongs to no subpackage
        for target in sorted(imported(path)):
            names = target.split(".")[1:]
            private = [i for i, name in enumerate(names) if name.startswith("_") and name != "__init__"]
            if private and names[0] != here:
                broken.append(f"ddp_eval.{'.'.join(parts)} imports {target}")
    assert not broken, "private modules imported from outside their subpackage:\n" + "\n".join(broken)


def _package_files():
    return {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")}


def test_lint_sees_every_module_of_the_package():
    """ruff's default exclusions (``dist``, ``build``, ...) must not hide a module: every
    file under ddp_eval/ is one that ``ruff check . --show-files`` lists (issue 38)."""
    import subprocess
    import sys
    shown = subprocess.run([sys.executable, "-m", "ruff", "check", ".", "--show-files"], cwd=PACKAGE.parent,
                           capture_output=True, text=True, check=True).stdout
    linted = {str(pathlib.Path(line.strip()).resolve().relative_to(PACKAGE.parent)) for line in shown.splitlines()
              if line.strip().endswith(".py") and pathlib.Path(line.strip()).resolve().is_relative_to(PACKAGE)}
    assert _package_files() - linted == set(), "modules ruff does not lint"


def test_doctests_are_collected_from_every_module_of_the_package():
    """pytest's ``norecursedirs`` (``dist``, ``build``, ...) must not hide a module: every
    module of ddp_eval/ with a doctest example has its doctests collected (issue 38)."""
    import subprocess
    import sys
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "ddp_eval"],
                            cwd=PACKAGE.parent, capture_output=True, text=True).stdout
    collected = {line.split("::")[0] for line in listed.splitlines() if "::" in line}
    with_examples = {f for f in _package_files() if ">>> " in (PACKAGE.parent / f).read_text()}
    assert with_examples, "no module with a doctest: the check would pass on nothing"
    assert "ddp_eval/distributed/__init__.py" in with_examples
    assert with_examples - collected == set(), "modules whose doctests pytest does not collect"
