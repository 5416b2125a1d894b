"""The named seams resolve to what production code calls, and every fault reaches the system under test
only through them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from harness.faults import FAULTS, deaths, engine, trainer
from reference_impl import seams


@pytest.mark.parametrize("name", sorted(seams.SEAMS))
def test_every_seam_resolves_to_a_callable(name: str) -> None:
    assert callable(seams.current(name))


def test_replace_swaps_and_returns_the_previous_callable() -> None:
    from reference_impl.transport import sync

    before = sync.update_info
    try:
        previous = seams.replace("update_info", lambda orig: lambda chunk: ("wrapped", orig(chunk)))
        assert previous is before
        assert sync.update_info is not before and sync.update_info.__code__.co_name == "<lambda>"
    finally:
        seams.restore_all()
    assert sync.update_info is before


def test_unknown_seam_says_which_exist() -> None:
    with pytest.raises(KeyError, match="known seams: talks_to_engine, train_step"):
        seams.replace("no_such_seam", lambda orig: orig)


def test_faults_patch_only_through_seams() -> None:
    """No fault module assigns to an attribute of an imported module or class: every change to the system
    under test goes through `seams.replace` (the only place that sets such attributes)."""
    for module in (trainer, engine):
        tree = ast.parse(Path(inspect.getfile(module)).read_text())
        imported = {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        targets = [t for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets]
        patched = [
            ast.unparse(t)
            for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in imported
        ]
        assert not patched, (module.__name__, patched)
        called = {node.args[0].value for node in ast.walk(tree) if _is_replace_call(node)}
        assert called <= set(seams.SEAMS)


def test_a_snapshot_sees_a_replacement_until_it_is_undone() -> None:
    """`replaced_since` reads the seams themselves: it sees a fault (`convert` replaced) until `restore_all`
    undoes it, and also a replacement `replace` never recorded."""
    from reference_impl.export import stream

    unfaulted = seams.snapshot()
    assert set(unfaulted) == set(seams.TRAINER_SEAMS)
    original = stream.convert
    try:
        trainer.gqa_split_wrong()
        assert seams.replaced_since(unfaulted) == ["convert"]
        assert seams.restore_all() == ["convert"]
        assert seams.replaced_since(unfaulted) == []
        stream.convert = lambda *args: original(*args)  # bypasses `replace`: restore_all cannot undo it
        assert seams.restore_all() == []
        assert seams.replaced_since(unfaulted) == ["convert"]
    finally:
        stream.convert = original
    trainer.gather_buffers_keyed_by_size()  # a seam that is a method of a class: read on the class
    try:
        assert seams.replaced_since(unfaulted) == ["gather_buffer"]
    finally:
        seams.restore_all()
    assert seams.replaced_since(unfaulted) == []


def test_trainer_seams_are_the_ones_trainer_faults_replace() -> None:
    """`TRAINER_SEAMS` (what a trainer rank compares after a fault) holds every seam a trainer fault replaces,
    and none an engine fault replaces."""
    trainer_side, engine_side = set(seams.TRAINER_SEAMS), set(seams.SEAMS) - set(seams.TRAINER_SEAMS)
    for module, side in ((trainer, trainer_side), (deaths, trainer_side), (engine, engine_side)):
        tree = ast.parse(Path(inspect.getfile(module)).read_text())
        called = {node.args[0].value for node in ast.walk(tree) if _is_replace_call(node)}
        assert called and called <= side, (module.__name__, sorted(called - side))


def test_every_fault_is_applied_from_its_side() -> None:
    for fault in FAULTS.values():
        assert fault.trainer is not None or fault.engine is not None, fault.name
        if fault.trainer is not None:
            assert fault.trainer.__module__ in ("harness.faults.trainer", "harness.faults.deaths"), fault.name
        if fault.engine is not None:
            assert fault.engine.__module__ == "harness.faults.engine", fault.name
            assert fault.hook == f"harness.faults.engine:{fault.engine.__name__}"


def _is_replace_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "replace"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "seams"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
    )
