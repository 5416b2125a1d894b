"""Scenarios: schema, validation, matrix expansion and filters.

A matrix file (`scenarios/<name>.yaml`) is a list of entries. An entry is one scenario, or several
when some of its fields are lists (`tp: [1, 2]` expands to one scenario per value; the product over
all list-valued axes). Every scenario gets a stable id that reads like a path:
`[<engine>/]<model>/tp<T>-pp<P>[-ep<E>]/<noncolocate|colocate>/<raw|bridge>[/<suffix>]` (the engine
only when it is not the embedded one, e.g. `vllm/qwen3/tp2-pp1/noncolocate/raw`).

Validation happens before any process starts: a scenario that cannot run (TP does not divide the
heads, PP larger than the layers, an unknown model or mode, ...) gets a `config_error` sentence that
says what to change, and is recorded as CONFIG_ERROR without launching anything.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from reference_impl.models.registry import ModelEntryError, load_model
from reference_impl.trainer.parallel import world_size_for

SCENARIOS_DIR = Path(__file__).resolve().parents[1] / "scenarios"

AXES = ("model", "tp", "pp", "ep", "colocate", "mode", "bucket_bytes", "engine")
ENGINES = ("embedded", "vllm")
DEFAULT_BUCKET_BYTES = 1 << 20  # 1 MiB


class Scenario(BaseModel):
    """One scenario: the model x parallel layout x placement x export mode, and how to run it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    colocate: bool = False
    mode: str = "raw"  # raw | bridge
    engine: str = "embedded"
    syncs: int = Field(default=5, ge=1)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    dtype: str = "float32"
    seed: int = 1234
    engine_seed: int = 4321
    tags: list[str] = Field(default_factory=list)
    expect: str = "PASS"
    fault: str | None = None
    suffix: str = ""  # distinguishes scenarios that share model/layout/placement/mode; {field} placeholders
    group: str = ""  # scenarios with the same group_key must leave bit-identical engine weights
    deadline_s: float | None = None  # per-sync deadline; None = from bytes and a margin
    logprobs: bool = True  # compare engine and trainer log-probs on fixed prompts after every sync
    # None: the engine's way. The embedded engine applies temperature to prompt log-probs (0.7 exercises
    # that path); vLLM computes them before any sampling processor, i.e. at temperature 1.0.
    logprob_temperature: float | None = Field(default=None, gt=0)
    description: str = ""

    @property
    def id(self) -> str:
        """Stable id, e.g. `qwen3-vl/tp2-pp2/noncolocate/bridge`."""
        layout = f"tp{self.tp}-pp{self.pp}" + (f"-ep{self.ep}" if self.ep > 1 else "")
        placement = "colocate" if self.colocate else "noncolocate"
        parts = [self.model, layout, placement, self.mode]
        if self.engine != "embedded":  # the engine leads: `vllm/qwen3/tp2-pp1/noncolocate/raw`
            parts.insert(0, self.engine)
        if self.suffix:
            parts.append(self.suffix.format(**self.model_dump(exclude={"suffix"})))
        return "/".join(parts)

    @property
    def group_key(self) -> str:
        """`group` plus everything but the suffix: members differ only in how they send (e.g. bucket size)."""
        return f"{self.group}:{self.id.rsplit('/', 1)[0] if self.suffix else self.id}" if self.group else ""

    @property
    def world_size(self) -> int:
        """Trainer ranks: PP x lcm(TP, EP x ETP) (`reference_impl.trainer.parallel.world_size_for`)."""
        return world_size_for(self.tp, self.pp, self.ep, self.etp)

    @property
    def temperature(self) -> float:
        """The temperature log-probs are compared at (`logprob_temperature`, else the engine's default)."""
        if self.logprob_temperature is not None:
            return self.logprob_temperature
        return 1.0 if self.engine == "vllm" else 0.7

    def as_dict(self) -> dict[str, Any]:
        """Plain dict with the id (what a record stores)."""
        return {"id": self.id, "group_key": self.group_key, **self.model_dump()}


def validate(sc: Scenario) -> str | None:
    """None when `sc` can run; else one sentence saying what to change."""
    if sc.mode not in ("raw", "bridge"):
        return f"mode {sc.mode!r} is unknown: use raw or bridge"
    if sc.engine not in ENGINES:
        return f"engine {sc.engine!r} is unknown: use one of {', '.join(ENGINES)}"
    if sc.dtype not in ("float32", "bfloat16"):
        return f"dtype {sc.dtype!r} is not supported: use float32 or bfloat16"
    if min(sc.tp, sc.pp, sc.ep, sc.etp) < 1:
        return "tp, pp, ep and etp must be >= 1"
    if sc.bucket_bytes < 1:
        return f"bucket_bytes must be >= 1 (got {sc.bucket_bytes})"
    try:
        spec = load_model(sc.model)
    except ModelEntryError as e:
        return str(e)
    f = spec.facts()
    if spec.hf_repo:
        from reference_impl.models.hf_cache import WeightsMissing, find_snapshot

        if sc.dtype != "bfloat16":
            return f"{sc.model} serves its released bfloat16 weights: set dtype: bfloat16"
        try:
            find_snapshot(spec.hf_repo)
        except WeightsMissing as e:
            return str(e)
    if (sc.ep > 1 or sc.etp > 1) and not f.num_experts:
        return f"ep {sc.ep} / etp {sc.etp} needs a mixture-of-experts model; {sc.model} is dense: set ep: 1, etp: 1"
    if f.num_experts and f.num_experts % sc.ep:
        return f"EP {sc.ep} does not divide {sc.model}'s {f.num_experts} experts: pick an EP that divides it"
    if sc.etp not in (1, sc.tp):
        return f"ETP {sc.etp} must be 1 or equal TP {sc.tp}"
    if f.num_heads % sc.tp or f.num_kv_heads % sc.tp:
        return (
            f"TP {sc.tp} does not divide {sc.model}'s {f.num_heads} attention heads and {f.num_kv_heads} "
            f"KV heads: pick a TP that divides both (e.g. {_divisors_of_both(f.num_heads, f.num_kv_heads)})"
        )
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
    if sc.fault is not None:
        from harness.faults import FAULTS

        if sc.fault not in FAULTS:
            return f"fault {sc.fault!r} is unknown: use one of {sorted(FAULTS)}"
        if sc.engine != "embedded" and FAULTS[sc.fault].side == "engine":
            return f"fault {sc.fault!r} is injected into the embedded engine's code: use engine: embedded"
    if sc.engine == "vllm":
        return _vllm_problem(sc, f)
    return None


def _vllm_problem(sc: Scenario, f: Any) -> str | None:
    """What keeps `sc` from running on real vLLM on this host (None when nothing does)."""
    if not sc.logprobs:
        return (
            "engine vllm needs logprobs: true: vLLM reports no per-tensor checksums in HF names, so log-prob "
            "parity is the only evidence of what it holds"
        )
    if sc.logprob_temperature not in (None, 1.0):
        return (
            f"logprob_temperature {sc.logprob_temperature} cannot be compared on vLLM: it computes prompt "
            "log-probs before any sampling processor (gpu_model_runner _get_prompt_logprobs_dict), i.e. at "
            "temperature 1.0; leave logprob_temperature unset or set it to 1.0"
        )
    if sc.colocate:
        return (
            "engine vllm runs non-colocate only: its weights travel over the harness's gloo backend "
            "(reference_impl/engine/vllm), and the harness does not drive vLLM's CUDA IPC backend yet: set "
            "colocate: false, or use engine: embedded for colocate"
        )
    if f.vision_heads:
        return (
            f"engine vllm cannot check {sc.model} here: its image prompt needs vLLM's chat route (a tokenizer and "
            "chat template; /v1/completions takes no images), and on CPU vLLM's Qwen3-VL path imports torchvision, "
            "which has no CPU build for torch 2.13 on PyPI: use engine: embedded"
        )
    import torch

    if f.num_experts and not torch.cuda.is_available():
        return (
            f"engine vllm on CPU is not set up for mixture-of-experts models ({sc.model}): use engine: embedded "
            "here, or a GPU host"
        )
    return _env_problem()


def _env_problem() -> str | None:
    from reference_impl.engine.vllm.env import EngineEnvMissing, vllm_python

    try:
        vllm_python()
    except EngineEnvMissing as e:
        return str(e)
    return None


def _divisors_of_both(a: int, b: int) -> list[int]:
    return [d for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0]


def expand(entry: dict[str, Any]) -> list[Scenario]:
    """One matrix entry -> scenarios (product over list-valued axes in `AXES`)."""
    axes = {k: v for k, v in entry.items() if k in AXES and isinstance(v, list)}
    fixed = {k: v for k, v in entry.items() if k not in axes}
    out = []
    for values in itertools.product(*axes.values()):
        out.append(Scenario(**fixed, **dict(zip(axes.keys(), values, strict=True))))
    return out


def load_matrix(name_or_path: str) -> list[Scenario]:
    """Scenarios of a matrix: a name under `scenarios/` (`cpu` -> scenarios/cpu.yaml) or a path.

    Raises:
        FileNotFoundError: no such matrix (the message lists the available ones).
        ValueError: two scenarios share an id.
    """
    path = Path(name_or_path)
    if not path.exists():
        path = SCENARIOS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no matrix {name_or_path!r}: use one of {names} or a path to a YAML file")
    entries = yaml.safe_load(path.read_text()) or []
    scenarios = [sc for e in entries for sc in expand(e)]
    ids = [s.id for s in scenarios]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"{path.name}: scenario ids appear twice, add a suffix: {dupes}")
    return scenarios


def select(scenarios: list[Scenario], expr: str | None) -> list[Scenario]:
    """Filter scenarios by an expression: space-separated terms, all must hold.

    A term is `key=value` (scenario field, e.g. `tp=2`, `mode=bridge`, `model=qwen3-vl`), `tag:NAME`,
    `!tag:NAME` (leave out a tag, e.g. `!tag:full-size`), or a regex searched in the id.
    """
    if not expr:
        return scenarios
    out = []
    for sc in scenarios:
        d = sc.as_dict()
        ok = True
        for term in expr.split():
            neg = term.startswith("!")
            t = term[1:] if neg else term
            if t.startswith("tag:"):
                hit = t[4:] in sc.tags
            elif "=" in t:
                k, v = t.split("=", 1)
                hit = str(d.get(k)).lower() == v.lower()
            else:
                hit = re.search(t, sc.id) is not None
            ok = ok and (hit != neg)
        if ok:
            out.append(sc)
    return out
