"""Token log-probs and entropies of a causal LM head, naive and chunked ("fused").

Both paths compute, for every position t, `logits[t] = hidden[t] @ weight.T / temperature` in fp32,
`logp[t] = log_softmax(logits[t])`, the log-prob of `targets[t]` and the entropy
`-(exp(logp[t]) * logp[t]).sum()`. `naive_logprobs` materialises the [T, V] logits;
`fused_logprobs` walks the tokens in chunks so only one [chunk, V] block (and its log-softmax) exists
at a time. Without autograd the peak extra memory is therefore O(chunk * V) instead of O(T * V).

For next-token log-probs of a prompt `ids` with final hidden states `h` [L, H]:
`targets = ids[1:]`, `hidden = h[:-1]`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> None:
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be 2-D [T, H], got shape {tuple(hidden.shape)}")
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden is [T={hidden.shape[0]}, H={hidden.shape[1]}] but weight is "
            f"[V={weight.shape[0]}, H={weight.shape[1]}]"
        )
    _check_targets(targets, hidden.shape[0], weight.shape[0])
    _check_temperature(temperature)


def _check_targets(targets: Tensor, t: int, v: int) -> None:
    if targets.ndim != 1 or targets.shape[0] != t:
        raise ValueError(f"targets must be 1-D of length T={t}, got shape {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if t and (int(targets.min()) < 0 or int(targets.max()) >= v):
        raise ValueError(f"targets must lie in [0, V={v}), got min {int(targets.min())} max {int(targets.max())}")


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def logprobs_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` and entropies from logits.

    Args:
        logits: [T, V], any floating dtype (computed in fp32).
        targets: [T] integer token ids in [0, V).
        temperature: > 0; the logits are divided by it before the softmax.

    Returns:
        (logprobs [T] fp32, entropy [T] fp32).

    Raises:
        ValueError: logits not 2-D, targets not [T] integers in range, temperature not finite and > 0.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D [T, V], got shape {tuple(logits.shape)}")
    _check_targets(targets, logits.shape[0], logits.shape[1])
    _check_temperature(temperature)
    return _logprobs_entropy(logits.float(), targets, temperature)


def _logprobs_entropy(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def naive_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies through the full [T, V] fp32 logits (the reference).

    Args:
        hidden: [T, H] final hidden states (after the final norm), any floating dtype.
        weight: [V, H] LM head weight (see `output_weight`), any floating dtype.
        targets: [T] integer token ids in [0, V).
        temperature: > 0; divides the logits.

    Returns:
        (logprobs [T] fp32, entropy [T] fp32); the matmul runs in fp32.

    Raises:
        ValueError: wrong ranks, H of hidden != H of weight, len(targets) != T, targets out of range,
            temperature not finite and > 0.
    """
    _check_inputs(hidden, weight, targets, temperature)
    logits = hidden.float() @ weight.float().T
    return _logprobs_entropy(logits, targets, temperature)


def fused_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk_tokens: int = 256
) -> tuple[Tensor, Tensor]:
    """Same result as `naive_logprobs`, computed `chunk_tokens` tokens at a time.

    Only one chunk's [chunk_tokens, V] fp32 logits (and its log-softmax) exist at once; the weight is
    upcast to fp32 once ([V, H]). Under autograd each chunk's intermediates are kept for backward, so the
    memory bound holds for inference (`torch.no_grad`) only.

    Args:
        hidden: [T, H] final hidden states, any floating dtype.
        weight: [V, H] LM head weight, any floating dtype.
        targets: [T] integer token ids in [0, V).
        temperature: > 0; divides the logits.
        chunk_tokens: tokens per chunk, >= 1 (need not divide T).

    Returns:
        (logprobs [T] fp32, entropy [T] fp32).

    Raises:
        ValueError: as `naive_logprobs`, and chunk_tokens < 1.
    """
    _check_inputs(hidden, weight, targets, temperature)
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    w = weight.float()
    lps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens].float()
        lp, ent = _logprobs_entropy(h @ w.T, targets[start : start + chunk_tokens], temperature)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat(lps), torch.cat(ents)


def output_weight(hf_model: torch.nn.Module) -> Tensor:
    """The LM head weight [V, H] of a transformers causal LM or Qwen3-VL model.

    With tied embeddings (`tie_word_embeddings` of the top-level config, else of its text config) this
    is the input embedding's weight, and the two must share storage.

    Raises:
        ValueError: the model has no output embeddings.
        AssertionError: tied embeddings are configured but the head and the embedding do not share storage.
    """
    head = hf_model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(hf_model).__name__} has no output embeddings (LM head)")
    weight: Tensor = head.weight
    cfg = hf_model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    # The top-level flag decides (a VL config's text_config may carry its class default, e.g. True for
    # Qwen3-VL-MoE whose top level says False); a config without one falls back to its text config.
    tied = bool(getattr(cfg, "tie_word_embeddings", getattr(text_cfg, "tie_word_embeddings", False)))
    if tied:
        emb = hf_model.get_input_embeddings().weight
        same = (
            weight.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()
            and weight.storage_offset() == emb.storage_offset()
            and weight.shape == emb.shape
        )
        if not same:
            raise AssertionError(
                f"{type(hf_model).__name__}: tie_word_embeddings is set but lm_head.weight and the input "
                "embedding do not share storage"
            )
    return weight
