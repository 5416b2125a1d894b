"""Trainer log-probs from the trainer's own Megatron model, as an RL trainer computes old-policy log-probs.

`megatron_logprobs` is called collectively on every trainer rank (TP / PP / EP / ETP, the default process
group). For each fixed prompt (`hf.fixed_prompts`) it runs one forward-only micro-batch (batch 1,
seq_length = the prompt's length) through megatron-core's pipeline schedule
(`megatron.core.pipeline_parallel.get_forward_backward_func()`, `forward_only=True`,
`collect_non_loss_data=True`): the first stage embeds (and, for Qwen3-VL, runs the vision tower), hidden
states travel point to point between stages, and on the last stage the TP-sharded logits go through
`vocab_parallel_logprobs` (max, sum of exp and target logit all-reduced over the TP group, fp32, token
chunks). The last stage of global rank 0's pipeline hands the log-probs to rank 0 point to point.

Seams (module-level functions, looked up at call time, so a fault injection can replace them):
- `forward_kwargs(model, prompt)`: the keyword arguments of the model chunk's forward for one prompt
  (for Qwen3-VL the image inputs);
- `last_stage_logprobs(...)`: the last stage's reduction, which hands the temperature to the kernel;
- `vocab_parallel_logprobs(...)`: the fused log-prob kernel, which divides the logits by the temperature.

Qwen3-VL / Qwen3-VL-MoE go through Megatron-Bridge 0.6.2's `Qwen3VLModel.forward`
(`megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py`): given `input_ids` [b, s],
`pixel_values` and `image_grid_thw`, it runs the vision tower, scatters the image embeddings where
`input_ids == image_token_id`, builds `visual_pos_masks` and the deepstack embeddings and hands them to
its language model, and computes mRoPE position ids from `input_ids` and `image_grid_thw` on every
stage (it uses caller position ids only when they are [3, b, s]; we pass none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from reference_impl.forward.hf import Prompt, check_position_ids
from reference_impl.forward.logprobs import _check_temperature
from reference_impl.models.families import model_family
from reference_impl.trainer.cpu_shims import cuda_factories_to_cpu
from reference_impl.trainer.model import TrainerModel

FORWARD_NAME = "Megatron forward (pipeline schedule, vocab-parallel fused log-probs)"

DEFAULT_CHUNK_TOKENS = 256


def forward_kwargs(model: TrainerModel, prompt: Prompt) -> dict[str, Any]:
    """Keyword arguments of the model chunk's forward for one prompt, batch 1, no padding.

    Text models (megatron-core `GPTModel.forward`): `input_ids` [1, T] int64, `position_ids` [1, T]
    int64 (0..T-1), `attention_mask` None (the local spec's attention is causal by mask type and builds
    its own mask; it would ignore a padding mask, so prompts are never padded).

    Qwen3-VL (Megatron-Bridge `Qwen3VLModel.forward`): `input_ids` [1, T], `position_ids` None (the
    model computes the mRoPE ids [3, 1, T] itself), `attention_mask` None, `pixel_values`
    [N, C * temporal * patch * patch] in the model's params dtype and `image_grid_thw` [n_images, 3]
    int64 when the prompt has an image. Every PP stage gets them: later stages need `input_ids` and
    `image_grid_thw` for the mRoPE ids; only the first stage runs the vision tower.
    """
    device = _device(model)
    ids = torch.tensor([prompt.input_ids], dtype=torch.long, device=device)
    if not _is_vl(model):
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
        return {"input_ids": ids, "position_ids": positions, "attention_mask": None}
    kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": None, "attention_mask": None}
    if prompt.pixel_values is not None:
        kwargs["pixel_values"] = prompt.pixel_values.to(device=device, dtype=model.config.params_dtype)
        kwargs["image_grid_thw"] = prompt.image_grid_thw.to(device)
    return kwargs


def _device(model: TrainerModel) -> torch.device:
    return next(model.chunks[0].parameters()).device


def _is_vl(model: TrainerModel) -> bool:
    return model_family(model.model_type).is_vl


def _all_reduce(t: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _check_kernel_inputs(
    logits: Tensor, targets: Tensor, temperature: float, vocab_start: int, vocab_size: int, chunk_tokens: int
) -> None:
    _check_temperature(temperature)
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D [T, V_local], got shape {tuple(logits.shape)}")
    if targets.ndim != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"targets must be [T={logits.shape[0]}], got shape {tuple(targets.shape)}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(f"targets must lie in [0, vocab_size={vocab_size})")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Log-probs of `targets` under softmax(logits / temperature) over a vocabulary sharded across `group`.

    Each rank of `group` (the TP group) holds the logit columns [vocab_start, vocab_start + V_local) of
    the same tokens. Per chunk of `chunk_tokens` tokens, in fp32: the local max over the real columns is
    all-reduced (MAX), then the local sum of exp(z - max) and the target's logit (from the one shard that
    owns the target id, 0 elsewhere) are all-reduced (SUM) together; logprob = target - max - log(sum).
    Only one [chunk, V_local] fp32 block exists at a time; the full [T, V] logits are never gathered.
    Columns at or beyond `vocab_size` (Megatron's vocab padding) are excluded.

    Args:
        logits: [T, V_local], any floating dtype (upcast to fp32 chunk by chunk).
        targets: [T] integer global token ids in [0, vocab_size).
        temperature: > 0; the logits are divided by it.
        vocab_start: global id of this shard's first column (tp_rank * V_local).
        vocab_size: the real vocabulary size (ids >= it are padding).
        group: the process group over which the vocabulary is sharded (None: not sharded).
        chunk_tokens: tokens per chunk, >= 1.

    Returns:
        [T] fp32 log-probs, identical on every rank of `group`.

    Raises:
        ValueError: logits not 2-D, targets not [T] or out of [0, vocab_size), temperature not finite
            and > 0, chunk_tokens < 1, or vocab_start < 0.
    """
    _check_kernel_inputs(logits, targets, temperature, vocab_start, vocab_size, chunk_tokens)
    n_real = max(0, min(logits.shape[1], vocab_size - vocab_start))  # columns of this shard that are real ids
    local = targets.long() - vocab_start
    owned = (local >= 0) & (local < n_real)
    out: list[Tensor] = []
    for s in range(0, logits.shape[0], chunk_tokens):
        z = logits[s : s + chunk_tokens, :n_real].float() / temperature
        if n_real:
            zmax = z.max(dim=-1).values
            idx = local[s : s + chunk_tokens].clamp(0, n_real - 1).unsqueeze(-1)
            target = torch.where(owned[s : s + chunk_tokens], z.gather(-1, idx).squeeze(-1), 0.0)
        else:  # a shard of padding only: contributes nothing
            zmax = z.new_full((z.shape[0],), -torch.inf)
            target = z.new_zeros((z.shape[0],))
        zmax = _all_reduce(zmax, dist.ReduceOp.MAX, group)
        sums = torch.stack([(z - zmax.unsqueeze(-1)).exp().sum(dim=-1), target])
        sums = _all_reduce(sums, dist.ReduceOp.SUM, group)
        out.append(sums[1] - zmax - sums[0].log())
    return torch.cat(out) if out else logits.new_zeros((0,), dtype=torch.float32)


def last_stage_logprobs(
    targets: Tensor, temperature: float, vocab_size: int, output: Tensor, non_loss_data: bool = True
) -> Tensor:
    """The schedule's reduction on the last stage (`collect_non_loss_data=True`, so the schedule calls
    it as `fn(output, non_loss_data=True)` and stores what it returns): this TP rank's logits
    [1, T, V_local] (megatron-core `GPTModel._postprocess` returns [b, s, V/TP] with
    `parallel_output=True`) -> next-token log-probs [T-1] fp32 (position t scores `targets[t]`, the
    token t+1), through `vocab_parallel_logprobs` over the TP group at `temperature`.

    Raises:
        ValueError: the output is not [1, T, V_local].
    """
    from megatron.core import parallel_state as ps

    if output.ndim != 3 or output.shape[0] != 1:
        raise ValueError(f"expected last-stage logits [1, T, V_local], got {tuple(output.shape)}")
    v_local = output.shape[-1]
    return vocab_parallel_logprobs(
        output[0, :-1],
        targets,
        temperature,
        vocab_start=ps.get_tensor_model_parallel_rank() * v_local,
        vocab_size=vocab_size,
        group=ps.get_tensor_model_parallel_group(),
    )


def _forward_step(targets: Tensor, temperature: float, vocab_size: int, data: Iterator[dict], chunk: Any) -> tuple:
    out = chunk(**next(data))
    return out, partial(last_stage_logprobs, targets, temperature, vocab_size)


def prompt_logprobs(model: TrainerModel, prompt: Prompt, temperature: float) -> Tensor | None:
    """One prompt through the pipeline schedule (collective on every rank).

    Returns [T-1] fp32 log-probs on the last PP stage (every TP / DP rank of it), None on other stages.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    targets = torch.tensor(prompt.input_ids[1:], dtype=torch.long, device=_device(model))
    step = partial(_forward_step, targets, temperature, int(model.config.vocab_size))
    # On CPU, megatron-core's schedule and default causal mask allocate on device "cuda" (cpu_shims).
    on_cpu = cuda_factories_to_cpu() if not torch.cuda.is_available() else contextlib.nullcontext()
    kwargs = forward_kwargs(model, prompt)
    if _is_vl(model) and kwargs.get("position_ids") is not None:
        # Megatron-Bridge's Qwen3VLModel silently drops position ids that are not [3, b, s] and computes its
        # own: refuse them here instead of training on ids nobody used.
        check_position_ids(kwargs["position_ids"], 1, len(prompt.input_ids))
    with torch.no_grad(), on_cpu:
        store = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter([kwargs]),
            model=model.chunks,
            num_microbatches=1,
            seq_length=len(prompt.input_ids),
            micro_batch_size=1,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    if len(store) != 1:
        raise RuntimeError(f"the pipeline schedule returned {len(store)} results for one micro-batch")
    return store[0]


def megatron_logprobs(model: TrainerModel, prompts: list[Prompt], temperature: float) -> list[list[float]] | None:
    """Next-token log-probs of every prompt at `temperature` from this rank's Megatron model shard.

    Collective: every trainer rank calls it with the same prompts. On the last PP stage the TP-sharded
    logits go through `vocab_parallel_logprobs`; the last stage of global rank 0's pipeline sends the
    concatenated log-probs (fp32) to rank 0 (gloo / NCCL send-recv on the default group).

    Args:
        model: this rank's `TrainerModel` (built by `trainer.model.build_model`, eval mode).
        prompts: `reference.fixed_prompts(config)`, each with at least 2 tokens.
        temperature: > 0.

    Returns:
        On global rank 0: one list of T_i - 1 floats per prompt (log-prob of token t+1 given tokens
        <= t). None on every other rank.

    Raises:
        ValueError: temperature not finite and > 0, a prompt shorter than 2 tokens.
    """
    from megatron.core import parallel_state as ps

    _check_temperature(temperature)
    if any(len(p.input_ids) < 2 for p in prompts):
        raise ValueError("every prompt needs at least 2 tokens")
    results = [prompt_logprobs(model, p, temperature) for p in prompts]
    lengths = [len(p.input_ids) - 1 for p in prompts]
    rank = dist.get_rank()
    last = ps.get_pipeline_model_parallel_last_rank()  # global rank of my pipeline's last stage
    if rank == 0:
        if last == 0:
            flat = torch.cat([r for r in results if r is not None])
        else:
            flat = torch.empty(sum(lengths), dtype=torch.float32, device=_device(model))
            dist.recv(flat, src=last)
        return [x.tolist() for x in flat.float().cpu().split(lengths)]
    if ps.is_pipeline_last_stage() and ps.get_pipeline_model_parallel_first_rank() == 0:
        dist.send(torch.cat([r for r in results if r is not None]).float().contiguous(), dst=0)
    return None
