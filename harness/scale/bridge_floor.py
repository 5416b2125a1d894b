"""Where the bridge export's time goes, and its floor: `python -m harness.scale.bridge_floor`.

Two trainer ranks (TP x EP on two ranks, PP 1; gloo on 127.0.0.1, one thread each) build one model from
its seeded checkpoint and run three exports in turn, `repeats` times each, consuming every tensor as the
sync loop does (and dropping it):
- `raw`: the raw export (`export.stream`), its TP gathers and EP all-gathers into buffers kept between syncs
  (no EP gather for a family whose HF checkpoint names each expert apart: each EP rank exports its own
  experts, which a sync then hands to the sender; this tool drops them, so no hand-off is timed);
- `bridge`: Megatron-Bridge's export as the harness runs it (`export.bridge`). Inside it, rank 0 times
  library calls (wrappers that only read the clock): `torch.distributed.all_gather` (the TP gather, into
  one new tensor per rank, and the EP gather of stacked experts, one collective per expert weight;
  per-expert HF names take the EP-size-1 fast path, `export.bridge.stage_tasks`), `torch.cat` (joining
  the shards, a copy of every gathered byte), `param_mapping.split_qkv_weights` (the fused QKV split, by
  advanced indexing), `remove_non_pickleables` (a copy of the model's config that every QKV mapping
  makes on every export, two or three levels deep) and `SafeTensorsStateSource.load_tensors` (reads of
  the HF checkpoint: the grouped expert export loads each stacked expert tensor, only for its shape);
  each export's all-gathers are counted;
- `floor`: the same export with library internals replaced in this process only, as the library could
  do them: `MegatronParamMapping.gather_from_tp_ranks` gathers into one tensor kept per mapping from sync
  to sync (`all_gather_into_tensor`; the raw export gathers into kept tensors too, point to point on a
  host) and returns its slices, and
  `gather_from_ep_ranks` likewise for the EP gather (still one collective per expert weight, as in the
  raw export); the QKV split takes strided views (`view_split_qkv`); the config copy is made once per
  config and kept; and the checkpoint answers from its safetensors headers (`header_state`: tensors on
  the meta device, shape and dtype only). The library's `cat` of the slices stays.
  Its tensors must equal the library's and the raw export's bit for bit (checked on the first repeat).
Seconds are medians of the steady repeats (the first, which allocates, is left out).
"""

from __future__ import annotations

import argparse
import queue
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from reference_impl.engine.process import free_port
from reference_impl.trainer.layout import world_size_for

PARTS = ("all_gather", "cat", "split_qkv", "config_copy", "checkpoint_read")
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


# safetensors header dtype names (the format's spec, `safetensors` README "Format") -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def header_shapes(checkpoint: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in the `*.safetensors` files of `checkpoint`, read from the
    files' headers only (no tensor data is read).

    Raises:
        FileNotFoundError: `checkpoint` holds no `*.safetensors` file.
        KeyError: a header names a dtype outside `SAFETENSORS_DTYPES`.
    """
    from safetensors import safe_open

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {checkpoint}")
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                part = f.get_slice(key)
                out[key] = (tuple(part.get_shape()), SAFETENSORS_DTYPES[part.get_dtype()])
    return out


def header_state(checkpoint: Path) -> Any:
    """A Megatron-Bridge `StateDict` over `checkpoint` whose tensors are meta tensors of the stored shape
    and dtype (`header_shapes`): what the library's export needs from the checkpoint (key lists, the
    shape of a stacked expert tensor) without reading its data. Reading a value from it fails (meta
    tensors hold none), so an export that needed the checkpoint's values would stop, not pass.
    """
    from megatron.bridge.models.hf_pretrained.state import StateDict, StateSource

    shapes = header_shapes(checkpoint)

    class HeaderSource(StateSource):
        def get_all_keys(self) -> list[str]:
            return sorted(shapes)

        def load_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
            return {k: torch.empty(shapes[k][0], dtype=shapes[k][1], device="meta") for k in keys if k in shapes}

    return StateDict(HeaderSource())


def _rank(
    rank: int, world: int, port: int, model_name: str, tp: int, ep: int, dtype: str, repeats: int, out: Any
) -> None:
    from reference_impl.trainer.cpu_shims import apply_cpu_shims

    torch.set_num_threads(1)
    apply_cpu_shims()
    import megatron.bridge.models.conversion.param_mapping as pm
    from megatron.bridge.models.hf_pretrained.state import SafeTensorsStateSource

    from reference_impl.checksum import tensor_checksum
    from reference_impl.export import stream
    from reference_impl.models.checkpoint import make_checkpoint
    from reference_impl.models.registry import load_model
    from reference_impl.trainer.model import build_model
    from reference_impl.trainer.parallel import init_distributed, init_model_parallel
    from reference_impl.trainer.params import GatherBuffers

    spent = dict.fromkeys(PARTS, 0.0)
    calls = {"collectives": 0}

    def timed(part: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = f(*args, **kwargs)
            spent[part] += time.perf_counter() - t0
            return result

        return call

    library = {
        "gather": pm.MegatronParamMapping.gather_from_tp_ranks,
        "ep_gather": pm.MegatronParamMapping.gather_from_ep_ranks,
        "split": pm.split_qkv_weights,
        "config_copy": pm.remove_non_pickleables,
    }

    kept: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # (mapping, shape) -> its gather output
    ep_kept: dict[tuple[int, str, tuple[int, ...]], torch.Tensor] = {}  # (mapping, HF name, shape) -> same

    def one_tensor_gather(self: Any, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.tp_size == 1:
            return [tensor]
        shape = (self.tp_size * tensor.shape[0], *tensor.shape[1:])
        flat = kept.get((id(self), shape))
        if flat is None:
            flat = kept[(id(self), shape)] = tensor.new_empty(shape)
        torch.distributed.all_gather_into_tensor(flat, tensor.contiguous(), group=self.tp_group)
        return list(flat.chunk(self.tp_size))

    def one_tensor_ep_gather(
        self: Any, weights: torch.Tensor | None, module: Any, hf_name: str | None
    ) -> dict[str, torch.Tensor]:
        # The library's EP gather (global expert = local + E/EP x EP rank; one entry per EP rank, or, where
        # the HF name holds no expert id, the EP ranks' tensors stacked), gathering into one kept tensor.
        if self.ep_size == 1 or weights is None or module is None:
            return library["ep_gather"](self, weights, module, hf_name)
        per_rank = self._get_config(module).num_moe_experts // self.ep_size
        local = pm.extract_expert_number_from_param(self.megatron_param) % per_rank
        names = [
            re.sub(r"experts\.(\d+)", f"experts.{local + per_rank * k}", str(hf_name)) for k in range(self.ep_size)
        ]
        shape = (self.ep_size, *weights.shape)
        key = (id(self), str(hf_name), shape)  # a gated MLP's mapping gathers gate and up in turn
        flat = ep_kept.get(key)
        if flat is None:
            flat = ep_kept[key] = weights.new_empty(shape)
        # gloo takes the flat (concatenated) form
        torch.distributed.all_gather_into_tensor(flat.view(-1), weights.contiguous().view(-1), group=self.ep_group)
        if len(set(names)) == len(names):
            return {name: flat[k].squeeze() for k, name in enumerate(names)}
        return {names[0]: flat.squeeze()}

    def view_split(provider: Any, qkv: torch.Tensor, feature_dim: int | None = None) -> tuple[torch.Tensor, ...]:
        if qkv.ndim != 2 or feature_dim is not None:
            return library["split"](provider, qkv, feature_dim)
        heads, groups = provider.num_attention_heads, provider.num_query_groups
        return view_split_qkv(qkv, heads, groups, provider.kv_channels or provider.hidden_size // heads)

    copies: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id(config), max_depth) -> (config, its copy)

    def kept_copy(obj: Any, max_depth: int = 3, current_depth: int = 0) -> Any:
        key = (id(obj), max_depth)
        if key not in copies:
            copies[key] = (obj, library["config_copy"](obj, max_depth, current_depth))
        return copies[key][1]

    spec = load_model(model_name)
    checkpoint = make_checkpoint(spec, seed=0, dtype=dtype)
    init_distributed(rank, world, "127.0.0.1", port)
    layout = init_model_parallel(tp, 1, ep)
    model = build_model(checkpoint, spec.model_type, tp, 1, dtype, ep=ep)
    config = stream.convert_config(spec, checkpoint)
    pretrained = model.bridge.hf_pretrained
    library_state, headers = pretrained.state, header_state(checkpoint)

    def counted(f: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls["collectives"] += 1
            return f(*args, **kwargs)

        return call

    # every export's all-gathers: the library's list form (timed), raw's flat form, the floor's into-tensor form
    torch.distributed.all_gather = counted(timed("all_gather", torch.distributed.all_gather))
    torch.distributed.all_gather_single = counted(torch.distributed.all_gather_single)
    torch.distributed.all_gather_into_tensor = counted(torch.distributed.all_gather_into_tensor)
    torch.cat = timed("cat", torch.cat)
    SafeTensorsStateSource.load_tensors = timed("checkpoint_read", SafeTensorsStateSource.load_tensors)
    buffers = GatherBuffers()
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    sums: dict[str, dict[str, str]] = {}
    for i in range(repeats + 1):  # the modes alternate, so a host's drift moves them alike
        for mode in MODES:
            floor = mode == "floor"
            pm.MegatronParamMapping.gather_from_tp_ranks = one_tensor_gather if floor else library["gather"]
            pm.MegatronParamMapping.gather_from_ep_ranks = one_tensor_ep_gather if floor else library["ep_gather"]
            pm.split_qkv_weights = view_split if floor else timed("split_qkv", library["split"])
            pm.remove_non_pickleables = kept_copy if floor else timed("config_copy", library["config_copy"])
            pretrained._state_dict_accessor = headers if floor else library_state
            spent.update(dict.fromkeys(PARTS, 0.0))
            calls["collectives"] = 0
            torch.distributed.barrier()
            t0 = time.perf_counter()
            export = stream.export("raw" if mode == "raw" else "bridge", model, layout, config, buffers=buffers)
            got = {name: tensor_checksum(t) if i == 0 else "" for name, t in export.tensors}
            rows[mode].append({"export_s": time.perf_counter() - t0, **spent, "all_gather_n": calls["collectives"]})
            if i == 0:
                sums[mode] = got
    if rank == 0:
        differ = sorted(
            n for n in sums["bridge"] if not sums["floor"].get(n) == sums["raw"].get(n) == sums["bridge"][n]
        )
        out.put({"rows": rows, "differ": differ + sorted(set(sums["floor"]) ^ set(sums["bridge"]))})
    torch.distributed.barrier()


def measure(
    model_name: str = "qwen3-0.6b", tp: int = 2, ep: int = 1, dtype: str = "bfloat16", repeats: int = 5
) -> dict[str, float]:
    """Run the two ranks (module doc) at TP `tp` x EP `ep` (PP 1) and return medians over the steady
    repeats, in seconds: `raw_s`, `bridge_s`, `floor_s` (each export), `all_gather_s`, `cat_s`,
    `split_qkv_s`, `config_copy_s`, `checkpoint_read_s` (inside the bridge export); `raw_all_gather_n`,
    `bridge_all_gather_n`, `floor_all_gather_n` (each export's all-gathers on rank 0, counts); `ratio`
    (bridge / raw) and `floor_ratio` (floor / raw). `dtype` is a name from `checkpoint.DTYPES`.

    Raises:
        ValueError: TP x EP does not fit two ranks (`layout.world_size_for`).
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback).
        AssertionError: the floor's tensors (or the raw export's) differ from the library's.
    """
    world = world_size_for(tp, 1, ep, 1)
    if world != 2:
        raise ValueError(f"TP {tp} x EP {ep} needs {world} ranks; this tool runs two (TP 2, EP 2, or TP 2 x EP 2)")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.spawn(
        _rank, args=(world, free_port(), model_name, tp, ep, dtype, repeats, out), nprocs=world, join=False
    )
    while True:  # a rank that fails ends the wait: join() raises its exception
        try:
            got = out.get(timeout=1)
            break
        except queue.Empty:
            procs.join(timeout=0)
    while not procs.join():
        pass
    assert not got["differ"], (
        f"the floor's (or raw's) exported tensors differ from Megatron-Bridge's: {got['differ'][:5]}"
    )

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in got["rows"][mode][1:])

    res = {f"{mode}_s": median(mode, "export_s") for mode in MODES}
    res.update({f"{p}_s": median("bridge", p) for p in PARTS})
    res.update({f"{mode}_all_gather_n": median(mode, "all_gather_n") for mode in MODES})
    res["ratio"], res["floor_ratio"] = res["bridge_s"] / res["raw_s"], res["floor_s"] / res["raw_s"]
    return res


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="registry name (models/registry.py)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    parser.add_argument("--dtype", default="bfloat16", help="checkpoint and parameter dtype (default bfloat16)")
    parser.add_argument("--repeats", type=int, default=5, help="steady repeats per mode (one warm-up more)")
    args = parser.parse_args(argv)
    res = measure(args.model, args.tp, args.ep, args.dtype, args.repeats)
    print("| quantity | value |\n| --- | ---: |")
    for key, value in res.items():
        print(f"| {key} | {value:.0f} |" if key.endswith("_n") else f"| {key} | {value:.3f} |")


if __name__ == "__main__":
    main()
