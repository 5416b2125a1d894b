"""Where the bridge export's time goes at TP > 1, and its floor: `python -m harness.scale.bridge_floor`.

Two trainer ranks (TP 2, PP 1, gloo on 127.0.0.1, one thread each) build one model from its seeded
checkpoint and run three exports in turn, `repeats` times each, consuming every tensor as the sync loop
does (and dropping it):
- `raw`: the raw export (`export.stream`), its TP all-gathers into buffers kept between syncs;
- `bridge`: Megatron-Bridge's export as the harness runs it (`export.bridge`). Inside it, rank 0 times
  three library calls (wrappers that only read the clock): `torch.distributed.all_gather` (the TP
  gather, into one new tensor per rank: gloo gathers into a flat buffer of its own, then copies out),
  `torch.cat` (joining the shards, a copy of every gathered byte) and `param_mapping.split_qkv_weights`
  (the fused QKV split, by advanced indexing);
- `floor`: the same export with two library internals replaced in this process only, as the library
  could do them: `MegatronParamMapping.gather_from_tp_ranks` gathers into one tensor kept per mapping
  from sync to sync (`all_gather_into_tensor`, as the raw export does) and returns its slices, and the
  QKV split takes strided views (`view_split_qkv`). The library's `cat` of the slices still copies.
  Its tensors must equal the library's bit for bit (checked on the first repeat, against raw's too).
Seconds are medians of the steady repeats (the first, which allocates, is left out).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from reference_impl.engine.process import free_port

PARTS = ("all_gather", "cat", "split_qkv")
MODES = ("raw", "bridge", "floor")


def view_split_qkv(qkv: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Q, K, V of Megatron's fused QKV weight [groups * (heads_per_group + 2) * head_dim, hidden] (per
    query group: its query heads, then one K head, then one V head; megatron-core
    `SelfAttention.get_query_key_value_tensors`), by strided views: Q [num_heads * head_dim, hidden], K
    and V [groups * head_dim, hidden], each a new contiguous tensor of the weight's dtype.

    Raises:
        ValueError: the weight's first dim is not groups * (heads_per_group + 2) * head_dim.
    """
    per_group = num_heads // num_query_groups
    if qkv.shape[0] != num_query_groups * (per_group + 2) * head_dim:
        raise ValueError(
            f"QKV weight of shape {tuple(qkv.shape)} does not fit {num_heads} heads in "
            f"{num_query_groups} groups of head_dim {head_dim}"
        )
    hidden = qkv.shape[-1]
    grouped = qkv.view(num_query_groups, per_group + 2, head_dim, hidden)
    return (
        grouped[:, :per_group].reshape(-1, hidden),
        grouped[:, per_group].reshape(-1, hidden),
        grouped[:, per_group + 1].reshape(-1, hidden),
    )


def _rank(rank: int, port: int, model_name: str, repeats: int, out: Any) -> None:
    from reference_impl.trainer.cpu_shims import apply_cpu_shims

    torch.set_num_threads(1)
    apply_cpu_shims()
    import megatron.bridge.models.conversion.param_mapping as pm

    from reference_impl.checksum import tensor_checksum
    from reference_impl.export import stream
    from reference_impl.models.checkpoint import make_checkpoint
    from reference_impl.models.registry import load_model
    from reference_impl.trainer.model import build_model
    from reference_impl.trainer.parallel import init_distributed, init_model_parallel
    from reference_impl.trainer.params import GatherBuffers

    spent = dict.fromkeys(PARTS, 0.0)

    def timed(part: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = f(*args, **kwargs)
            spent[part] += time.perf_counter() - t0
            return result

        return call

    library = {"gather": pm.MegatronParamMapping.gather_from_tp_ranks, "split": pm.split_qkv_weights}

    kept: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # (mapping, shape) -> its gather output

    def one_tensor_gather(self: Any, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.tp_size == 1:
            return [tensor]
        shape = (self.tp_size * tensor.shape[0], *tensor.shape[1:])
        flat = kept.get((id(self), shape))
        if flat is None:
            flat = kept[(id(self), shape)] = tensor.new_empty(shape)
        torch.distributed.all_gather_into_tensor(flat, tensor.contiguous(), group=self.tp_group)
        return list(flat.chunk(self.tp_size))

    def view_split(provider: Any, qkv: torch.Tensor, feature_dim: int | None = None) -> tuple[torch.Tensor, ...]:
        if qkv.ndim != 2 or feature_dim is not None:
            return library["split"](provider, qkv, feature_dim)
        heads, groups = provider.num_attention_heads, provider.num_query_groups
        return view_split_qkv(qkv, heads, groups, provider.kv_channels or provider.hidden_size // heads)

    spec = load_model(model_name)
    checkpoint = make_checkpoint(spec, seed=0, dtype="bfloat16")
    init_distributed(rank, 2, "127.0.0.1", port)
    layout = init_model_parallel(2, 1)
    model = build_model(checkpoint, spec.model_type, 2, 1, "bfloat16")
    config = stream.convert_config(spec, checkpoint)
    torch.distributed.all_gather = timed("all_gather", torch.distributed.all_gather)
    torch.cat = timed("cat", torch.cat)
    buffers = GatherBuffers()
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    sums: dict[str, dict[str, str]] = {}
    for i in range(repeats + 1):  # the modes alternate, so a host's drift moves them alike
        for mode in MODES:
            floor = mode == "floor"
            pm.MegatronParamMapping.gather_from_tp_ranks = one_tensor_gather if floor else library["gather"]
            pm.split_qkv_weights = view_split if floor else timed("split_qkv", library["split"])
            spent.update(dict.fromkeys(PARTS, 0.0))
            torch.distributed.barrier()
            t0 = time.perf_counter()
            export = stream.export("raw" if mode == "raw" else "bridge", model, layout, config, buffers=buffers)
            got = {name: tensor_checksum(t) if i == 0 else "" for name, t in export.tensors}
            rows[mode].append({"export_s": time.perf_counter() - t0, **spent})
            if i == 0:
                sums[mode] = got
    if rank == 0:
        out.put({"rows": rows, "floor_same": sums["floor"] == sums["bridge"] == sums["raw"]})
    torch.distributed.barrier()


def measure(model_name: str = "qwen3-0.6b", repeats: int = 5) -> dict[str, float]:
    """Run the two ranks (module doc) and return medians over the steady repeats, in seconds: `raw_s`,
    `bridge_s`, `floor_s` (each export), `all_gather_s`, `cat_s`, `split_qkv_s` (inside the bridge
    export); and `ratio` (bridge / raw) and `floor_ratio` (floor / raw).

    Raises:
        AssertionError: the floor's tensors (or the raw export's) differ from the library's.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.spawn(_rank, args=(free_port(), model_name, repeats, out), nprocs=2, join=False)
    got = out.get()
    while not procs.join():
        pass
    assert got["floor_same"], "the floor's (or raw's) exported tensors differ from Megatron-Bridge's"

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in got["rows"][mode][1:])

    res = {f"{mode}_s": median(mode, "export_s") for mode in MODES}
    res.update({f"{p}_s": median("bridge", p) for p in PARTS})
    res["ratio"], res["floor_ratio"] = res["bridge_s"] / res["raw_s"], res["floor_s"] / res["raw_s"]
    return res


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="registry name (models/registry.py)")
    parser.add_argument("--repeats", type=int, default=5, help="steady repeats per mode (one warm-up more)")
    args = parser.parse_args(argv)
    res = measure(args.model, args.repeats)
    print("| quantity | seconds |\n| --- | ---: |")
    for key, value in res.items():
        print(f"| {key} | {value:.3f} |")


if __name__ == "__main__":
    main()
