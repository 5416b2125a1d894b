"""The oracles' own digests (`harness.oracles.digest`): the same hex digest as the system under test's checksum
for the same bytes, computed without it, so a checksum that hashes only part of a tensor disagrees with them."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

import reference_impl.checksum
from harness.oracles.digest import checkpoint_digests, tensor_digest
from harness.oracles.expected import ExpectedState
from reference_impl.checksum import tensor_checksum
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model

ROOT = Path(__file__).resolve().parents[1]
TENSORS = {
    "fp32": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
    "transposed": torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).t(),
    "bf16 rows of a larger tensor": torch.randn(8, 4, dtype=torch.bfloat16)[2:5],
    "int64": torch.arange(7),
    "bool": torch.tensor([True, False, True]),
    "empty": torch.zeros(0, 3),
}


def _by_hand(t: torch.Tensor) -> str:
    """XXH3-128 of the row-major bytes, through Python's own buffer of a fresh copy (no view of the tensor)."""
    copy = t.clone(memory_format=torch.contiguous_format)
    return xxhash.xxh3_128_hexdigest(bytes(copy.untyped_storage()))


@pytest.mark.parametrize("name", list(TENSORS))
def test_a_tensor_digest_is_xxh3_of_its_row_major_bytes_as_the_engine_and_sender_report_it(name: str) -> None:
    t = TENSORS[name]
    assert tensor_digest(t) == _by_hand(t) == tensor_checksum(t)


def test_one_changed_byte_anywhere_changes_the_digest() -> None:
    t = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(2))
    before = tensor_digest(t)
    t.view(torch.uint8).view(-1)[-1] ^= 1  # the last byte of 4 MiB
    assert tensor_digest(t) != before


def test_a_checkpoint_digest_is_read_from_the_files_bytes(tmp_path: Path) -> None:
    tensors = {n: t.contiguous() for n, t in TENSORS.items() if n != "empty"}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file({"more": torch.ones(2, 2, dtype=torch.float16)}, str(tmp_path / "b.safetensors"))
    loaded = {**load_file(tmp_path / "a.safetensors"), **load_file(tmp_path / "b.safetensors")}
    assert checkpoint_digests(tmp_path) == {n: _by_hand(t) for n, t in loaded.items()}
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match=r"b\.safetensors: no safetensors header"):
        checkpoint_digests(tmp_path)


def test_a_checksum_of_the_system_under_test_that_samples_disagrees_with_the_oracles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine and the sender report `reference_impl.checksum`; had the oracles used it too, a checksum that
    # hashed a sample "for speed" would have agreed with itself on every tensor, whatever the engine held.
    checkpoint = make_checkpoint(load_model("qwen3"), 1234)
    truth = checkpoint_digests(checkpoint)

    def sampled(data: bytes | memoryview) -> str:
        return xxhash.xxh3_128_hexdigest(bytes(memoryview(data)[:64]))

    monkeypatch.setattr(reference_impl.checksum, "bytes_checksum", sampled)
    stored = load_file(checkpoint / "model.safetensors")
    wrong = {n: t.clone() for n, t in stored.items()}
    for t in wrong.values():  # an engine that got each tensor's first 64 bytes right and nothing after
        t.view(-1).view(torch.uint8)[64:] ^= 0xFF
    big = [n for n, t in stored.items() if t.numel() * t.element_size() > 64]
    report = reference_impl.checksum.tensor_checksum
    assert big and all(report(wrong[n]) == report(stored[n]) for n in big)  # the sampled checksum agrees
    assert all(report(wrong[n]) != truth[n] for n in big)  # the oracle's digest of the checkpoint does not


def test_the_oracles_never_call_the_system_under_tests_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object) -> str:
        raise AssertionError("an oracle called reference_impl.checksum")

    monkeypatch.setattr(reference_impl.checksum, "bytes_checksum", refused)
    monkeypatch.setattr(reference_impl.checksum, "tensor_checksum", refused)
    checkpoint = make_checkpoint(load_model("qwen3"), 1234)
    sums = ExpectedState(checkpoint, seed=4242).advance(1).checksums()  # a seed no other test keeps
    assert len(sums) == len(checkpoint_digests(checkpoint))
    oracles = [*(ROOT / "harness" / "oracles").glob("*.py"), ROOT / "harness" / "runner.py"]
    imports = re.compile(
        r"^\s*(from reference_impl(\.checksum)? import .*checksum|import reference_impl\.checksum)",
        re.M,
    )
    assert not [p.name for p in oracles if imports.search(p.read_text())]
