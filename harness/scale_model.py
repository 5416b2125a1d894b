"""`python -m harness.scale_model ...`: the update-time model on paper (`docs/scaling.md`).

python -m harness.scale_model bytes [--dtype bfloat16]
    parameters, routed-expert parameters, HF tensors and bytes per sync of every shipped config
python -m harness.scale_model predict --model qwen3-4b --links h100 [--tp N --pp N --ep N]
        [--replicas N --engine-tp N] [--colocate] [--transfer gloo|nccl] [--remote-engine]
        [--chunk-bytes N] [--dtype bfloat16] [--per-stage-senders] [--sharded-engine] [--overlap]
    seconds per phase of one update (`--model`: an entry of scenarios/models/ or a key of
    `scale.published.ARCHITECTURES`; `--links`: a preset of `scale.presets`)
python -m harness.scale_model published
    each published figure beside the model's prediction on the same hardware
python -m harness.scale_model measure [--out FILE]
    this host's gloo (TCP) bandwidth, host copy bandwidth, small-message round trip (starts two
    processes: run it under the heavy-run lock on a shared host)
python -m harness.scale_model check --run results/<run-id> --links-json FILE
    predicted vs measured steady seconds for every PASS row of a run (CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness.scale.params import param_count
from harness.scale.presets import PRESETS, preset
from harness.scale.published import ARCHITECTURES, FIGURES, checkpoint_engine_s, ours_s, workload
from harness.scale.update_time import Design, Topology, predict, sender_held_bytes
from reference_impl.models.registry import MODELS_DIR, available_models, load_model


def model_config(name: str) -> dict[str, Any]:
    """The HF config of `name`: a model entry (scaled as the entry says), a shipped config file name,
    or a published architecture.

    Raises:
        KeyError: none of those.
    """
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    if (MODELS_DIR / name).is_file():
        return json.loads((MODELS_DIR / name).read_text())
    if name in available_models():
        return load_model(name).config
    raise KeyError(f"unknown model {name!r}: an entry of {MODELS_DIR}, a *.config.json there, or {list(ARCHITECTURES)}")


def _bytes(args: argparse.Namespace) -> None:
    print(f"| config | parameters | routed experts | HF tensors | bytes ({args.dtype}) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    names = sorted(p.name for p in MODELS_DIR.glob("*.config.json")) + list(ARCHITECTURES)
    for name in names:
        c = param_count(model_config(name))
        print(f"| {name} | {c.total:,} | {c.experts:,} | {c.tensors:,} | {c.bytes(args.dtype):,} |")


def _predict(args: argparse.Namespace) -> None:
    w = workload(model_config(args.model), args.dtype, args.chunk_bytes)
    topo = Topology(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        replicas=args.replicas,
        engine_tp=args.engine_tp,
        colocate=args.colocate,
        transfer=args.transfer,
        engine_same_node=not args.remote_engine,
    )
    design = Design(per_stage_senders=args.per_stage_senders, sharded_engine=args.sharded_engine, overlap=args.overlap)
    p = predict(w, topo, preset(args.links), design)
    print(f"{args.model}: {w.bytes / 1e9:.2f} GB, {w.tensors} tensors; {args.links}; {topo}; {design}")
    for k, v in p.phases.items():
        print(f"  {k:9s} {v:9.3f} s")
    print(f"  {'total':9s} {p.total:9.3f} s  (bottleneck: {p.bottleneck})")
    print(f"  the sender's chunk loop holds at most {sender_held_bytes(w, topo) / 1e9:.2f} GB of exported tensors")


def _published(_: argparse.Namespace) -> None:
    print("| figure | published (s) | model (s) | model / published | source |")
    print("| --- | ---: | ---: | ---: | --- |")
    for f in FIGURES:
        w = workload(model_config(f.model))
        links = preset(f.links)
        if f.model in ARCHITECTURES:
            model = checkpoint_engine_s(w, 8, links)["total"]
        else:
            model = ours_s(w, Topology(transfer="nccl"), links)
        print(f"| {f.name} | {f.seconds} | {model:.2f} | {model / f.seconds:.2f} | {f.source} |")


def _measure(args: argparse.Namespace) -> None:
    from harness.scale.measure import measure

    got = measure()
    text = json.dumps(got, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


def _check(args: argparse.Namespace) -> None:
    from harness.scale.check import compare

    df = compare(Path(args.run), json.loads(Path(args.links_json).read_text()))
    print("| scenario | predicted (s) | steady (s) | measured / predicted | bottleneck |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in df.to_dict("records"):
        cells = (r["scenario"], f"{r['predicted_s']:.4f}", f"{r['steady_s']:.4f}", f"{r['ratio']:.2f}", r["bottleneck"])
        print("| " + " | ".join(cells) + " |")
    ratio = df["ratio"]
    print(f"\nmeasured / predicted: median {ratio.median():.2f}, min {ratio.min():.2f}, max {ratio.max():.2f}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad arguments)."""
    ap = argparse.ArgumentParser(prog="python -m harness.scale_model", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bytes")
    b.add_argument("--dtype", default="bfloat16")
    p = sub.add_parser("predict")
    p.add_argument("--model", required=True)
    p.add_argument("--links", default="h100", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-bytes", type=int, default=1 << 30)
    for name in ("tp", "pp", "ep", "replicas", "engine-tp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--transfer", default="gloo", choices=("gloo", "nccl"))
    for flag in ("colocate", "remote-engine", "per-stage-senders", "sharded-engine", "overlap"):
        p.add_argument(f"--{flag}", action="store_true")
    sub.add_parser("published")
    m = sub.add_parser("measure")
    m.add_argument("--out", default=None)
    c = sub.add_parser("check")
    c.add_argument("--run", required=True)
    c.add_argument("--links-json", required=True)
    args = ap.parse_args(argv)
    {"bytes": _bytes, "predict": _predict, "published": _published, "measure": _measure, "check": _check}[args.cmd](
        args
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
