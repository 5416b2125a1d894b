"""Scenarios: schema, validation, matrix expansion and filters.

A matrix file (`scenarios/<name>.yaml`) is a list of entries. An entry is one scenario, or several
when some of its fields are lists (`tp: [1, 2]` expands to one scenario per value; the product over
all list-valued axes). Every scenario gets a stable id that reads like a path:
`[<engine>/]<model>/tp<T>-pp<P>[-ep<E>][-etp<T>]/<noncolocate|colocate>[-engines<N>][-engine-tp<T>]/<raw|bridge>[/<suffix>]`
(the engine only when it is not the embedded one, e.g. `vllm/qwen3/tp2-pp1/noncolocate/raw`; the engine
replicas and the engine's own TP only when > 1, e.g. `qwen3/tp1-pp1/noncolocate-engines2/raw`).

This module is data only; `harness.validate` judges whether a scenario can run (before any process
starts: a scenario that cannot run gets a sentence that says what to change, recorded as CONFIG_ERROR
without launching anything).
"""

from __future__ import annotations

import difflib
import functools
import itertools
import re
import string
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from reference_impl.engine import DEFAULT_ENGINE
from reference_impl.trainer.layout import world_size_for

SCENARIOS_DIR = Path(__file__).resolve().parents[1] / "scenarios"

AXES = ("model", "tp", "pp", "ep", "colocate", "export_mode", "chunk_bytes", "engine", "engines", "engine_tp")
DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB
SUFFIX_CHARS = re.compile(r"[A-Za-z0-9._+=-]+")  # what one level of an id may hold (`one_level`)
SUFFIX_MAX = 100


def one_level(text: str) -> bool:
    """Whether `text` can be one level of a scenario id and part of a file name: only `SUFFIX_CHARS`, and not
    `.` or `..` (the model and a filled suffix are such levels)."""
    return bool(SUFFIX_CHARS.fullmatch(text)) and text not in (".", "..")


# fields that count: YAML's true/false is refused there (`Scenario._no_bool`)
WHOLE_NUMBERS = ("tp", "pp", "ep", "etp", "engines", "engine_tp", "syncs", "chunk_bytes", "seed", "engine_seed")


class Scenario(BaseModel):
    """One scenario: the model x parallel layout x placement x export mode, and how to run it."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    colocate: bool = False
    export_mode: str = "raw"  # raw | bridge
    engine: str = DEFAULT_ENGINE  # an engine kind of `reference_impl.engine.ENGINES`
    # Rollout engine replicas of that kind, all fed by one transfer group (`harness.validate` checks both).
    engines: int = 1
    engine_tp: int = 1  # each engine's own tensor parallelism: its ranks in the transfer group
    syncs: int = Field(default=5, ge=1)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    dtype: str = "float32"
    seed: int = 1234
    engine_seed: int = 4321
    tags: list[str] = Field(default_factory=list)
    expect: str = "PASS"
    expect_note: str = ""  # a phrase some check must also say (e.g. "oracle could not run"), with `expect`
    fault: str | None = None
    fault_sync: int | None = None  # arm a trainer fault for this sync only (fail once, then recover)
    suffix: str = ""  # distinguishes scenarios that share model/layout/placement/mode; {field} placeholders
    group: str = ""  # scenarios with the same group_key must leave bit-identical engine weights
    deadline_s: float | None = Field(default=None, gt=0)  # per-sync deadline (s); None = from bytes and a margin
    logprobs: bool = True  # compare engine and trainer log-probs on fixed prompts after every sync
    # None: the engine's way. The embedded engine applies temperature to prompt log-probs (0.7 exercises
    # that path); vLLM computes them before any sampling processor, i.e. at temperature 1.0.
    logprob_temperature: float | None = Field(default=None, gt=0)
    description: str = ""

    @field_validator(*WHOLE_NUMBERS, "fault_sync", mode="before")
    @classmethod
    def _no_bool(cls, value: object) -> object:
        """YAML's `true` is no count: pydantic would take it as 1 (`syncs: true` ran 1 sync)."""
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is a yes/no, not a whole number")
        return value

    @field_validator("model")
    @classmethod
    def _model_is_one_level(cls, value: str) -> str:
        """The model is the id's first level (after a non-default engine): a registry name, never a path or a
        Hugging Face repo id (`Qwen/Qwen3-0.6B` gave a CONFIG_ERROR row whose id had a level too many)."""
        if not one_level(value):
            raise ValueError(
                f"{value!r} is no model name: name a model of scenarios/models/ (e.g. qwen3-0.6b), not a path or a "
                "Hugging Face id"
            )
        return value

    @model_validator(mode="after")
    def _suffix_is_one_level(self) -> Scenario:
        """The suffix, its `{field}` placeholders filled (`filled_suffix`), is the id's last level and part of
        file names: a placeholder must be a bare field name (no attribute, index, conversion or format spec), and
        the filled suffix at most `SUFFIX_MAX` characters of `SUFFIX_CHARS`, not `.` or `..` (a `/` would add
        levels to the id, a space would split a filter term, a very long one overflows a file name)."""
        fields = set(Scenario.model_fields) - {"suffix"}
        try:
            parts = list(string.Formatter().parse(self.suffix))
        except ValueError as e:
            raise ValueError(f"suffix {self.suffix!r}: {e}: a placeholder is {{NAME}}, a scenario field") from None
        for _, name, spec, conversion in parts:
            if name is not None and (name not in fields or spec or conversion):
                raise ValueError(
                    f"suffix {self.suffix!r}: {{{name}{'!' + conversion if conversion else ''}"
                    f"{':' + spec if spec else ''}}} is no bare field name: write {{NAME}} with one of {sorted(fields)}"
                )
        unset = [name for _, name, _, _ in parts if name is not None and getattr(self, name) is None]
        if unset:
            raise ValueError(f"suffix {self.suffix!r}: {unset[0]} is unset here, so {{{unset[0]}}} would read None")
        suffix = self.filled_suffix
        if "/" in suffix:
            raise ValueError(f"suffix {suffix!r} has a '/', which would add levels to the id: join its words with '-'")
        if self.suffix and (not one_level(suffix) or len(suffix) > SUFFIX_MAX):
            raise ValueError(
                f"suffix {suffix!r} must be 1 to {SUFFIX_MAX} letters, digits or . _ + = - (not . or ..): it is the "
                "id's last level and part of the records' file names"
            )
        return self

    @property
    def filled_suffix(self) -> str:
        """The suffix with its `{field}` placeholders filled, e.g. `chunk-65536` for `chunk-{chunk_bytes}`."""
        return self.suffix.format(**self.model_dump(exclude={"suffix"}))

    @property
    def id(self) -> str:
        """Stable id, e.g. `qwen3-vl/tp2-pp2/noncolocate/bridge`."""
        layout = f"tp{self.tp}-pp{self.pp}" + (f"-ep{self.ep}" if self.ep > 1 else "")
        layout += f"-etp{self.etp}" if self.etp != 1 else ""  # entries that differ only in ETP get ids of their own
        placement = "colocate" if self.colocate else "noncolocate"
        placement += (f"-engines{self.engines}" if self.engines != 1 else "") + (
            f"-engine-tp{self.engine_tp}" if self.engine_tp != 1 else ""
        )
        parts = [self.model, layout, placement, self.export_mode]
        if self.engine != DEFAULT_ENGINE:  # another engine leads: `vllm/qwen3/tp2-pp1/noncolocate/raw`
            parts.insert(0, self.engine)
        if self.suffix:
            parts.append(self.filled_suffix)
        return "/".join(parts)

    @property
    def group_key(self) -> str:
        """`group` plus everything but the suffix: members differ only in how they send (e.g. chunk size)."""
        return f"{self.group}:{self.id.rsplit('/', 1)[0] if self.suffix else self.id}" if self.group else ""

    @property
    def world_size(self) -> int:
        """Trainer ranks: PP x lcm(TP, EP x ETP) (`reference_impl.trainer.layout.world_size_for`)."""
        return world_size_for(self.tp, self.pp, self.ep, self.etp)

    @property
    def engine_ranks(self) -> list[int]:
        """Transfer-group ranks of each engine replica (its TP workers): `[engine_tp] * engines`."""
        return [self.engine_tp] * self.engines

    def temperature(self, honours_temperature: bool) -> float:
        """The temperature log-probs are compared at: `logprob_temperature`, else 0.7 on an engine whose
        prompt log-probs honour the temperature (exercises that path) and 1.0 on one whose do not
        (`Capabilities.prompt_logprobs_honour_temperature`)."""
        if self.logprob_temperature is not None:
            return self.logprob_temperature
        return 0.7 if honours_temperature else 1.0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict with the id (what a record stores)."""
        return {"id": self.id, "group_key": self.group_key, **self.model_dump()}


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
        ValueError: the file is not a matrix (not YAML, not a list of entries, an entry that is not a mapping
            of fields, a field of the wrong type, a list axis with no value, no entry at all), or two scenarios
            share an id; the message names the file and the entry, and what to change.
    """
    names = sorted(p.stem for p in SCENARIOS_DIR.glob("*.yaml"))
    named = SCENARIOS_DIR / f"{name_or_path}.yaml"
    # a name (`cpu`) is the committed matrix, also where the working folder holds a folder of that name
    path = named if name_or_path in names else Path(name_or_path)
    if not path.exists():
        if path.suffix in (".yaml", ".yml") or "/" in name_or_path:  # a path: say that it is missing
            raise FileNotFoundError(f"matrix file {name_or_path} does not exist: check the path, or use one of {names}")
        raise FileNotFoundError(f"no matrix {name_or_path!r}: use one of {names} or a path to a YAML file")
    if path.is_dir():
        raise ValueError(f"matrix {str(path)!r} is a folder: pass a YAML file in it, or one of {names}")
    try:
        entries = yaml.load(path.read_text(), Loader=_MatrixLoader)
    except MatrixKeyError as e:
        raise ValueError(f"{path}, {e}") from None
    except yaml.YAMLError as e:
        where = str(e).replace(' in "<unicode string>",', " at")  # the file is named first
        raise ValueError(f"{path}: not valid YAML: {' '.join(where.split())}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8") from None
    if not entries:
        raise ValueError(f"{path}: no entries; {MATRIX_SHAPE}")
    if not isinstance(entries, list):
        what = {dict: "a mapping", str: "text", int: "a number", float: "a number"}.get(type(entries), "a value")
        raise ValueError(f"{path}: {what} at the top, not a list; {MATRIX_SHAPE}")
    scenarios = [sc for i, e in enumerate(entries, 1) for sc in _expand_entry(path, i, e)]
    ids = [s.id for s in scenarios]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"{path.name}: scenario ids appear twice, add a suffix: {dupes}")
    return scenarios


class MatrixKeyError(yaml.YAMLError):
    """A key of a matrix file's mapping that no entry can have (`_MatrixLoader`); the message says its line."""


class _MatrixLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (`{tp: 1, tp: 2}`: the last one silently
    won, and the scenario ran at TP 2), and a key YAML reads as other than text (`on:` is the bool True, `2:` a
    number), named as written. A key that overrides one a merge key (`<<: *base`) brought in is no repeat:
    that is what merging is for."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):  # YAML 1.1 reads `on:`, `yes:`, `no:` as bools, `2:` as a number
                written = key_node.value if isinstance(key_node, yaml.ScalarNode) else key
                raise MatrixKeyError(
                    f"line {line}: {written!r} is no field name (YAML reads it as the {type(key).__name__} {key!r}): "
                    f"quote it, '{written}':"
                )
            if key in seen:
                raise MatrixKeyError(
                    f"line {line}: {key!r} is given twice in one mapping: keep one (YAML itself would keep the last "
                    "in silence)"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


MATRIX_SHAPE = "a matrix is a list of entries, each a mapping of fields: `- {model: qwen3, tp: [1, 2]}`"


def _expand_entry(path: Path, index: int, entry: object) -> list[Scenario]:
    """`expand` for entry `index` (from 1) of matrix `path`, with errors that name both."""
    where = f"{path}, entry {index}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: {entry!r} is not a mapping of fields; {MATRIX_SHAPE}")
    listed = [k for k, v in entry.items() if isinstance(v, list) and k not in AXES and k != "tags"]
    if listed:
        raise ValueError(
            f"{where}: {listed[0]} is given a list, and only {', '.join(AXES)} expand into one scenario per value: "
            f"give {listed[0]} one value, or write one entry per value"
        )
    empty = [k for k in AXES if entry.get(k) == []]
    if empty:
        raise ValueError(f"{where}: {empty[0]}: [] gives no scenario: list at least one value")
    try:
        return expand(entry)
    except ValidationError as e:
        raise ValueError(f"{where}: {'; '.join(_field_error(err) for err in e.errors())}") from None


def _field_error(err: Any) -> str:
    """One of pydantic's errors (`ValidationError.errors()`) as a phrase that names the field: an unknown field
    with the nearest known one, a missing one, or the field, the rule and the value given."""
    field = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        near = difflib.get_close_matches(field.lower(), Scenario.model_fields, n=1)  # `TP:` is tp
        hint = f"did you mean {near[0]}?" if near else f"fields: {', '.join(Scenario.model_fields)}"
        return f"{field} is no scenario field ({hint})"
    if err["type"] == "missing":
        return f"{field} is required"
    msg = err["msg"].removeprefix("Value error, ")
    if not field:  # a rule over several fields (`Scenario._suffix_is_one_level`)
        return msg
    given = "" if err["type"] == "value_error" else f", not {err['input']!r}"
    if err["type"] == "string_type":  # YAML read `1.2` or `2024-01-01` as a number or a date
        given += " (quote it, as text)"
    return f"{field}: {msg[0].lower()}{msg[1:]}{given}{_number_hint(err['input'])}"


def _number_hint(value: object) -> str:
    """A hint for a number YAML read as text (`1e6`: YAML 1.1 wants `1.0e+6`)."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return ""
        if number.is_integer():
            return f" (YAML reads {value!r} as text: write {int(number)})"
    return ""


def _is_key_value(term: str) -> bool:
    """`tp=2`, not a regex with a `=` in it (`(?=raw)`)."""
    key, sep, _ = term.partition("=")
    return bool(sep) and key.isidentifier()


def _filter_terms(expr: str) -> list[tuple[str, bool, str, str, object]]:
    """The terms of a filter, each as (term, negated, kind, key, value): kind `tag` (value: the tag), `field` (key
    and the value read as the field's type, `_field_value`) or `regex` (value: the pattern).

    Raises:
        ValueError: a term that can only select nothing or all: a `key=value` whose key is no scenario field
            (`tags=` too: tags are selected with `tag:NAME`), an empty tag, term or value, a double `!`, a term
            that is no regex or a regex that begins `NAME:` (ids hold no ':'; `!tags:full-size` left out nothing), a
            value the field cannot take (`tp=two`); the message says what to write instead.
    """
    fields = {"id", "group_key", *Scenario.model_fields}
    terms = []
    for term in expr.split():
        t = term.removeprefix("!")
        if not t or t.startswith("!") or t == "tag:":
            raise ValueError(
                f"filter term {term!r} selects nothing or all: write tag:NAME, !tag:NAME, key=value or a regex"
            )
        neg = t != term
        if t.startswith("tag:"):
            terms.append((term, neg, "tag", "", t[4:]))
        elif _is_key_value(t):
            key, value = t.split("=", 1)
            if key == "tags":
                raise ValueError(f"filter term {term!r}: select by tag with tag:NAME (or !tag:NAME)")
            if key not in fields:
                near = difflib.get_close_matches(key.lower(), fields, n=1)
                hint = f"did you mean {near[0]}?" if near else f"use one of {sorted(fields)}"
                raise ValueError(f"filter term {term!r}: {key!r} is no scenario field: {hint}")
            if not value:
                raise ValueError(f"filter term {term!r} gives {key} no value: write {key}=VALUE (none for unset)")
            terms.append((term, neg, "field", key, _field_value(term, key, value)))
        else:
            try:
                re.compile(t)
            except re.error as e:
                raise ValueError(f"filter term {term!r} is neither key=value, tag:NAME nor a regex ({e})") from None
            if re.match(r"[A-Za-z_][\w-]*:", t):  # `tags:full-size`, `tga:gpu`: a regex no id can match
                raise ValueError(
                    f"filter term {term!r} is a regex that no id can match (ids hold no ':'): select by tag with "
                    "tag:NAME (or !tag:NAME)"
                )
            terms.append((term, neg, "regex", "", t))
    return terms


def _field_value(term: str, key: str, value: str) -> object:
    """`value` read as field `key` reads it in a matrix (pydantic's lax mode: `tp=02` is 2, `colocate=yes` is
    True); `none` is a field's unset value (None, or "" for `group`, `suffix`, `group_key`, ...); text fields (and
    `id`, `group_key`) stay text.

    Raises:
        ValueError: the field cannot take `value` (`tp=two`, `syncs=0`: no scenario could have it).
    """
    field = Scenario.model_fields.get(key)
    if field is None:  # id, group_key: text ("" where there is no group)
        return "" if key == "group_key" and value.lower() == "none" else value
    if value.lower() == "none" and type(None) in typing.get_args(field.annotation):
        return None
    if value.lower() == "none" and field.default == "":  # unset text: group, suffix, expect_note
        return ""
    try:
        bounded = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation  # its bounds
        return TypeAdapter(bounded).validate_python(value)
    except ValidationError as e:
        raise ValueError(f"filter term {term!r}: {key}: {e.errors()[0]['msg'].lower()}") from None


# Fields that name one of a few things (a model, an engine kind, a mode, a verdict, a fault): a filter value that no
# scenario here or in the committed matrices has is a typo or a thing that does not exist (`engine=sglang`).
NAMING_FIELDS = ("model", "engine", "export_mode", "dtype", "expect", "fault")


@functools.cache
def _committed() -> tuple[Scenario, ...]:
    """Every scenario of the committed matrices (`scenarios/*.yaml`)."""
    return tuple(sc for p in sorted(SCENARIOS_DIR.glob("*.yaml")) for sc in load_matrix(str(p)))


def committed_tags() -> frozenset[str]:
    """Every tag of the committed matrices (`scenarios/*.yaml`)."""
    return frozenset(t for sc in _committed() for t in sc.tags)


def select(scenarios: list[Scenario], expr: str | None) -> list[Scenario]:
    """Filter scenarios by an expression: space-separated terms, all must hold.

    A term is `key=value` (scenario field, e.g. `tp=2`, `export_mode=bridge`, `model=qwen3-vl`), `tag:NAME`,
    `!tag:NAME` (leave out a tag, e.g. `!tag:full-size`), or a regex searched in the id, in any case.

    Raises:
        ValueError: a term that can only select nothing or all (`_filter_terms`), a tag that no scenario of
            `scenarios` or of the committed matrices has (`!tag:fullsize` for `!tag:full-size` selected all), or
            a value of a `NAMING_FIELDS` field that none of them has (`engine=sglang`, `model=qwen4`).
    """
    if not expr:
        return scenarios
    terms = _filter_terms(expr)
    named = [(term, kind, key, value) for term, _, kind, key, value in terms if kind == "tag" or key in NAMING_FIELDS]
    # the committed matrices are read only for a filter that names a tag or a naming field's value
    known = [*scenarios, *_committed()] if named else []
    for term, kind, key, value in named:
        if kind == "tag":
            have = {t for sc in known for t in sc.tags}
            if value not in have:  # a typo: `!tag:fullsize` selected every scenario
                raise ValueError(
                    f"filter term {term!r}: no scenario here or in scenarios/ has tag {value!r}: check its spelling "
                    f"(tags: {', '.join(sorted(have))})"
                )
            continue
        have = {getattr(sc, key) for sc in known} - {None, ""}
        if isinstance(value, str) and value and value.lower() not in {h.lower() for h in have}:  # as `_matches`
            raise ValueError(
                f"filter term {term!r}: no scenario here or in scenarios/ has {key} {value!r}: check its spelling "
                f"({key}: {', '.join(sorted(map(str, have)))})"
            )
    return [sc for sc in scenarios if all(_matches(sc, kind, key, value) != neg for _, neg, kind, key, value in terms)]


def _matches(sc: Scenario, kind: str, key: str, value: object) -> bool:
    """Whether `sc` has the tag, the field value (text in any case; a suffix as written or with its placeholders
    filled) or an id the regex finds (in any case: `Qwen3-VL` finds `qwen3-vl`)."""
    if kind == "tag":
        return value in sc.tags
    if kind == "field":  # a field, or the id or group key; a suffix as written or filled (`chunk-65536`)
        got = [sc.suffix, sc.filled_suffix] if key == "suffix" else [getattr(sc, key)]
        return any(
            g.lower() == value.lower() if isinstance(g, str) and isinstance(value, str) else g == value for g in got
        )
    return re.search(value, sc.id, re.IGNORECASE) is not None  # in any case, as `key=value` compares text
