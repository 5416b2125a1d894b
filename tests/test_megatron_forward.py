"""The trainer's own Megatron forward (`reference_impl.forward.megatron`) against transformers.

Trainer ranks are plain processes (torch.multiprocessing, forked from a fork server that has imported what
they need) joined in a gloo default group, one pool per world size (1, 2, 4), reused across the cases of that
size. Each case builds the Megatron model through Megatron-Bridge (`trainer.model.build_model`), loads the
seeded checkpoint, and runs `megatron_logprobs` collectively at two temperatures. The truth is an independent
transformers forward over the checkpoint on disk (`forward.hf.HfForward` with `read_checkpoint`).

Qwen3-VL: Megatron-Bridge 0.6.2's vision patch mergers (the final merger and the deepstack mergers,
`modelling_qwen3_vl/utils.py` `Qwen3VLVisionPatchMerger`) apply the vision config's activation,
`gelu(approximate="tanh")`, where transformers' `Qwen3VLVisionPatchMerger` applies exact `nn.GELU()`.
The comparison within the fp32 budget therefore uses a transformers reference whose mergers use the tanh
approximation too; `test_vl_merger_gelu_is_the_gap_to_plain_transformers` pins the size of the gap.
"""

from __future__ import annotations

import gc
import queue
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from reference_impl.engine.process import free_port
from reference_impl.forward.hf import HfForward, fixed_prompts
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.trainer.parallel import world_size_for

pytestmark = pytest.mark.e2e

SEED = 1234  # the scenarios' default seed (harness.scenario.Scenario.seed)
TEMPERATURES = (0.7, 1.0)
BUDGET = {"float32": 1e-4, "bfloat16": 0.1}
JOB_TIMEOUT_S = 600


@dataclass(frozen=True)
class Case:
    model: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dtype: str = "float32"

    @property
    def world(self) -> int:
        return world_size_for(self.tp, self.pp, self.ep, self.etp)

    @property
    def id(self) -> str:
        return f"{self.model}/tp{self.tp}-pp{self.pp}-ep{self.ep}/{self.dtype}"

    @property
    def is_vl(self) -> bool:
        return "vl" in self.model


# Grouped by world size so that only one pool of rank processes is alive at a time.
CASES = [
    Case("qwen3"),
    Case("qwen3", dtype="bfloat16"),
    Case("qwen3-vl"),
    Case("qwen3", tp=2),
    Case("qwen3", pp=2),
    Case("qwen3-moe", ep=2),
    Case("qwen3", tp=2, pp=2),
    Case("qwen3-vl", tp=2, pp=2),
    Case("qwen3-vl-moe", ep=2, pp=2),
]
VL_CASES = [c for c in CASES if c.is_vl]


def _rank_main(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    """One trainer rank: join the gloo world, then run cases from `inbox` until None."""
    import torch.distributed as dist

    from reference_impl.trainer.parallel import init_distributed

    torch.set_num_threads(1)
    try:
        init_distributed(rank, world, "127.0.0.1", port)
        while (job := inbox.get()) is not None:
            outbox.put(("ok", rank, _run_case(*job)))
    except BaseException:
        outbox.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_case(case: Case, checkpoint: str) -> dict[str, Any] | None:
    """Build, load and run `megatron_logprobs` at every temperature; rank 0 returns the results."""
    import torch.distributed as dist

    from reference_impl.forward.megatron import megatron_logprobs
    from reference_impl.trainer.model import build_model
    from reference_impl.trainer.parallel import destroy_model_parallel, init_model_parallel

    spec = load_model(case.model)
    init_model_parallel(case.tp, case.pp, case.ep, case.etp)
    try:
        t0 = time.perf_counter()
        model = build_model(Path(checkpoint), spec.model_type, case.tp, case.pp, case.dtype, case.ep, case.etp)
        build_s = time.perf_counter() - t0
        prompts = fixed_prompts(spec.config)
        out: dict[float, Any] = {}
        seconds: dict[float, float] = {}
        for temperature in TEMPERATURES:
            t0 = time.perf_counter()
            out[temperature] = megatron_logprobs(model, prompts, temperature)
            seconds[temperature] = time.perf_counter() - t0
        del model
    finally:
        destroy_model_parallel()
        gc.collect()
    if dist.get_rank() != 0:
        assert all(v is None for v in out.values())
        return None
    return {"logprobs": out, "seconds": seconds, "build_s": build_s}


# What every rank imports, imported once in the fork server its ranks are forked from: each spawned rank would
# import torch, megatron-core and Megatron-Bridge itself (6-9 s of CPU apiece on a 2-core host).
RANK_IMPORTS = ["reference_impl.trainer.model", "reference_impl.trainer.parallel", "reference_impl.forward.megatron"]


class RankPool:
    """`world` rank processes in one gloo default group, forked from a fork server that has imported
    `RANK_IMPORTS` (fresh interpreters otherwise: no state of the test process is inherited); `close` ends
    every one of them."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(RANK_IMPORTS)
        self.world = world
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, self.inboxes[r], self.outbox), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, case: Case, checkpoint: Path) -> dict[str, Any]:
        """Run one case on every rank; rank 0's results. Raises RuntimeError with a rank's traceback."""
        for box in self.inboxes:
            box.put((case, str(checkpoint)))
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(replies) < self.world:
            try:
                status, rank, payload = self.outbox.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty as e:
                raise RuntimeError(f"{case.id}: ranks {sorted(set(range(self.world)) - set(replies))} timed out") from e
            if status == "error":
                raise RuntimeError(f"{case.id}: rank {rank} failed:\n{payload}")
            replies[rank] = payload
        return replies[0]

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


@pytest.fixture(scope="module")
def megatron_run() -> Iterator[Any]:
    """case -> rank 0's results, computed once per case; one pool alive at a time, all closed at the end."""
    pools: dict[str, RankPool] = {}
    cache: dict[Case, dict[str, Any]] = {}

    def run(case: Case) -> dict[str, Any]:
        if case not in cache:
            pool = pools.get("current")
            if pool is not None and pool.world != case.world:
                pool.close()
                pool = None
            if pool is None:
                pool = pools["current"] = RankPool(case.world)
            checkpoint = make_checkpoint(load_model(case.model), SEED, case.dtype)
            try:
                cache[case] = pool.run(case, checkpoint)
            except RuntimeError:
                pools.pop("current").close()  # a failed collective leaves the other ranks hanging
                raise
        return cache[case]

    yield run
    if "current" in pools:
        pools.pop("current").close()


_REFERENCE: dict[tuple[str, str, float, bool], list[torch.Tensor]] = {}


def reference_logprobs(case: Case, temperature: float, tanh_mergers: bool) -> list[torch.Tensor]:
    """Transformers log-probs [T-1] per fixed prompt over the checkpoint on disk. With `tanh_mergers`
    (VL only) the vision patch mergers use gelu(approximate="tanh"), as Megatron-Bridge's do."""
    key = (case.model, case.dtype, temperature, tanh_mergers)
    if key not in _REFERENCE:
        checkpoint = make_checkpoint(load_model(case.model), SEED, case.dtype)
        ref = HfForward(checkpoint)
        ref.load(read_checkpoint(checkpoint))
        if tanh_mergers:
            visual = ref.model.model.visual
            for merger in [visual.merger, *visual.deepstack_merger_list]:
                merger.act_fn = torch.nn.GELU(approximate="tanh")
        _REFERENCE[key] = [ref.logprobs(p, temperature)[0] for p in fixed_prompts(ref.config)]
    return _REFERENCE[key]


def max_abs_diff(got: list[list[float]], want: list[torch.Tensor]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    return max(
        float((torch.tensor(g, dtype=torch.float32) - w.float()).abs().max()) for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_megatron_logprobs_match_transformers(megatron_run: Any, case: Case) -> None:
    res = megatron_run(case)
    got = res["logprobs"][0.7]
    prompts = fixed_prompts(load_model(case.model).config)
    assert len(got) == len(prompts) == (3 if case.is_vl else 2)
    for g, p in zip(got, prompts, strict=True):
        assert len(g) == len(p.input_ids) - 1
        assert all(isinstance(x, float) and x <= 0.0 for x in g)
    diff = max_abs_diff(got, reference_logprobs(case, 0.7, tanh_mergers=case.is_vl))
    print(f"\n[measured] {case.id}: max|diff| {diff:.3g} (T=0.7), forward {res['seconds'][0.7]:.3f} s per prompt set")
    assert diff <= BUDGET[case.dtype]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_temperature_reaches_the_fused_log_probs(megatron_run: Any, case: Case) -> None:
    res = megatron_run(case)
    at_07, at_10 = res["logprobs"][0.7], res["logprobs"][1.0]
    assert max_abs_diff(at_10, reference_logprobs(case, 1.0, tanh_mergers=case.is_vl)) <= BUDGET[case.dtype]
    assert max_abs_diff(at_07, [torch.tensor(x) for x in at_10]) > 0.05


@pytest.mark.parametrize("case", VL_CASES, ids=lambda c: c.id)
def test_vl_merger_gelu_is_the_gap_to_plain_transformers(megatron_run: Any, case: Case) -> None:
    """Against plain transformers (exact GELU in the mergers) only the image prompt moves, by more than
    fp32 rounding and less than 1e-3; the text prompts stay within the budget."""
    got = megatron_run(case)["logprobs"][0.7]
    plain = reference_logprobs(case, 0.7, tanh_mergers=False)
    text_diff = max_abs_diff(got[:-1], plain[:-1])
    image_diff = max_abs_diff(got[-1:], plain[-1:])
    print(f"\n[measured] {case.id}: image prompt vs plain transformers max|diff| {image_diff:.3g}")
    assert text_diff <= BUDGET[case.dtype]
    assert 1e-5 < image_diff < 1e-3
