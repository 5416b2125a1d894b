"""Whether a scenario can run: one `validate` call per scenario, before any process starts.

A scenario that cannot run (TP does not divide the heads, PP larger than the layers, an unknown model,
mode or engine, a limit of the engine on this host, ...) gets one sentence that says what to change; it
is recorded as CONFIG_ERROR without launching anything. Model facts come from the model entry
(`reference_impl.models`), engine limits from the engine's adapter (`reference_impl.engine`).
"""

from __future__ import annotations

from harness.record import VERDICTS
from harness.scenario import Scenario
from reference_impl.engine import ENGINES, EngineRequest, engine_kind
from reference_impl.export import MODES
from reference_impl.models.registry import ModelEntryError, ModelSpec, load_model
from reference_impl.models.vllm_tp import padded_vocab

DTYPES = ("float32", "bfloat16")


def validate(sc: Scenario) -> str | None:
    """None when `sc` can run here; else one sentence saying what to change."""
    if sc.expect not in VERDICTS:
        return f"expect {sc.expect!r} is no verdict: use one of {', '.join(VERDICTS)}"
    if sc.export_mode not in MODES:
        return f"mode {sc.export_mode!r} is unknown: use {' or '.join(MODES)}"
    try:
        engine = engine_kind(sc.engine)
    except ValueError as e:
        return str(e)
    if sc.dtype not in DTYPES:
        return f"dtype {sc.dtype!r} is not supported: use {' or '.join(DTYPES)}"
    if min(sc.tp, sc.pp, sc.ep, sc.etp) < 1:
        return "tp, pp, ep and etp must be >= 1"
    problem = _engines_problem(sc)
    if problem:
        return problem
    if sc.chunk_bytes < 1:
        return f"chunk_bytes must be >= 1 (got {sc.chunk_bytes})"
    try:
        spec = load_model(sc.model)
    except ModelEntryError as e:
        return str(e)
    # what the scenario itself gets wrong first, then what this host lacks (a multi-GB cache of released weights)
    problem = (
        _layout_problem(sc, spec) or _engine_tp_problem(sc, spec) or _fault_problem(sc) or _weights_problem(sc, spec)
    )
    if problem:
        return problem
    return engine.validate(
        EngineRequest(spec, sc.dtype, sc.colocate, sc.logprobs, sc.logprob_temperature, sc.engines, sc.engine_tp)
    )


def _engines_problem(sc: Scenario) -> str | None:
    """`engines` (replicas fed by one transfer group) and `engine_tp` (each one's TP) are whole numbers >= 1,
    and a colocated engine is one engine of TP 1 (it shares the sender's devices and takes chunks by handle,
    with no transfer group to hold more ranks)."""
    for field, value, what in (
        ("engines", sc.engines, "the number of rollout engine replicas fed by one transfer group"),
        ("engine_tp", sc.engine_tp, "each engine's tensor parallelism (its ranks in the transfer group)"),
    ):
        if value < 1:  # whole numbers already: `Scenario` refuses text, fractions and true/false
            return f"{field} must be a whole number >= 1 ({what}); got {value!r}"
    if sc.colocate and (sc.engines > 1 or sc.engine_tp > 1):
        return (
            f"colocate shares the sender's devices with one engine of TP 1 (chunks by handle, no transfer group), "
            f"but engines is {sc.engines} and engine_tp {sc.engine_tp}: set colocate: false, or engines: 1 and "
            "engine_tp: 1"
        )
    return None


def _engine_tp_problem(sc: Scenario, spec: ModelSpec) -> str | None:
    """The engine's TP fits the model by vLLM's partition rules: `QKVParallelLinear` divides the query heads
    by TP and either divides the KV heads by TP or replicates each KV head over TP / KV ranks
    (`vllm/model_executor/layers/linear.py`, `divide` asserts exact division); `MergedColumnParallelLinear`
    divides the MLP's intermediate size by TP. The vocabulary is padded, so any TP fits it
    (`VocabParallelEmbedding`, `vocab_parallel_embedding.py`)."""
    if sc.engine_tp == 1:
        return None
    f = spec.model_config()
    t = sc.engine_tp
    if f.num_heads % t:
        return f"engine_tp {t} does not divide {sc.model}'s {f.num_heads} attention heads: pick an engine_tp that does"
    if f.num_kv_heads % t and t % f.num_kv_heads:
        return (
            f"engine_tp {t} neither divides {sc.model}'s {f.num_kv_heads} KV heads nor is a multiple of them (vLLM "
            "replicates KV heads only when TP is a multiple of their count): pick another engine_tp"
        )
    sizes = (("MLP intermediate size", f.ffn_hidden_size), ("expert intermediate size", f.moe_ffn_hidden_size))
    for what, size in sizes:
        if size and size % t:
            return f"engine_tp {t} does not divide {sc.model}'s {what} {size}: pick an engine_tp that does"
    if padded_vocab(f.vocab_size) % t:
        return (
            f"engine_tp {t} does not divide {sc.model}'s vocabulary padded to {padded_vocab(f.vocab_size)} rows "
            "(vLLM pads it to a multiple of 64): pick an engine_tp that does"
        )
    return None


def _weights_problem(sc: Scenario, spec: ModelSpec) -> str | None:
    """Released weights (`hf_repo` entries) must be in the local HF cache, in their own dtype."""
    if not spec.hf_repo:
        return None
    from reference_impl.models.hf_cache import WeightsMissing, find_snapshot

    if sc.dtype != "bfloat16":
        return f"{sc.model} serves its released bfloat16 weights: set dtype: bfloat16"
    try:
        find_snapshot(spec.hf_repo)
    except WeightsMissing as e:
        return str(e)
    return None


def _layout_problem(sc: Scenario, spec: ModelSpec) -> str | None:
    """The TP / PP / EP / ETP layout fits the model (megatron-core's divisibility rules)."""
    f = spec.model_config()
    if (sc.ep > 1 or sc.etp > 1) and not f.num_experts:
        return f"ep {sc.ep} / etp {sc.etp} needs a mixture-of-experts model; {sc.model} is dense: set ep: 1, etp: 1"
    if f.num_experts and f.num_experts % sc.ep:
        return f"EP {sc.ep} does not divide {sc.model}'s {f.num_experts} experts: pick an EP that divides it"
    if sc.etp not in (1, sc.tp):
        return f"ETP {sc.etp} must be 1 or equal TP {sc.tp}"
    heads, kv = f"{f.num_heads} attention heads", f"{f.num_kv_heads} KV heads"
    if f.num_heads % sc.tp or f.num_kv_heads % sc.tp:
        if f.num_heads % sc.tp and f.num_kv_heads % sc.tp:
            what = f"TP {sc.tp} divides neither {sc.model}'s {heads} nor its {kv}"
        elif f.num_heads % sc.tp:
            what = f"TP {sc.tp} does not divide {sc.model}'s {heads} (it divides its {kv})"
        else:
            what = f"TP {sc.tp} does not divide {sc.model}'s {kv} (it divides its {heads})"
        fits = ", ".join(str(d) for d in _divisors_of_both(f.num_heads, f.num_kv_heads))
        return f"{what}: pick a TP that divides both ({fits})"
    if f.vision_heads and f.vision_heads % sc.tp:
        return f"TP {sc.tp} does not divide {sc.model}'s {f.vision_heads} vision heads: pick a TP that divides it"
    if sc.pp > f.num_layers:
        return f"PP {sc.pp} is larger than {sc.model}'s {f.num_layers} layers: use PP <= {f.num_layers}"
    if f.num_layers % sc.pp:
        return f"PP {sc.pp} does not divide {sc.model}'s {f.num_layers} layers: use a PP that divides it"
    if f.deepstack_indexes and sc.pp > 1 and f.num_layers // sc.pp < len(f.deepstack_indexes):
        return (
            f"at PP {sc.pp} the first stage of {sc.model} holds {f.num_layers // sc.pp} text layers but the vision "
            f"tower feeds {len(f.deepstack_indexes)} deepstack layers into it: lower PP or add text layers"
        )
    return None


def _fault_problem(sc: Scenario) -> str | None:
    """A fault must be registered, and an engine-side fault needs an engine that loads fault hooks; a fault armed
    for one sync only (`fault_sync`) is a trainer fault, and that sync is one the scenario runs (0..`syncs`: the
    last re-sends unchanged weights, `harness.session.ScenarioSession.run_syncs`)."""
    if sc.fault is None:
        if sc.fault_sync is not None:
            return f"fault_sync {sc.fault_sync} arms no fault: name one (fault: ...) or leave fault_sync out"
        return None
    from harness.faults import FAULTS

    if sc.fault not in FAULTS:
        return f"fault {sc.fault!r} is unknown: use one of {sorted(FAULTS)}"
    if sc.fault_sync is not None:
        if FAULTS[sc.fault].trainer is None:
            return f"fault {sc.fault!r} is the engine's, armed at its start: leave fault_sync out"
        if not 0 <= sc.fault_sync <= sc.syncs:
            return (
                f"fault_sync {sc.fault_sync} is no sync of this scenario (0..{sc.syncs}, with syncs: {sc.syncs}): "
                f"pick one of those, or raise syncs"
            )
    if FAULTS[sc.fault].engine is not None and not engine_kind(sc.engine).capabilities.fault_hooks:
        hooks = [name for name, kind in ENGINES.items() if kind.capabilities.fault_hooks]
        return (
            f"fault {sc.fault!r} is a hook the engine loads at start and engine {sc.engine} loads none: "
            f"use engine: {' or '.join(hooks)}"
        )
    return None


def _divisors_of_both(a: int, b: int) -> list[int]:
    return [d for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0]
