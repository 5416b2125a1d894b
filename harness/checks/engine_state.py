"""The engine's state beyond its weights after a sync: the weights it started from, the version it
commits, and caches that must not outlive an update (PARITY_FAIL).

- `engine_fresh`: before sync 0 the engine holds a fresh engine's weights: its seed's dummy weights
  (`oracles.fresh`), none of the checkpoint's bytes, at weight version 0. Sync 0's parity
  (`parity.check_parity_sync0`) shows that the update moved the checkpoint into the engine only for
  tensors that held something else before: an engine started from the checkpoint itself (vLLM without
  `--load-format dummy`) passes sync 0 whatever the update did, and one reused from an earlier scenario
  that kept its weights hides, at every later sync, a tensor the update skipped.

- `weight_version`: after every finished sync the engine reports (`GET /weight_info`) the version that
  sync committed, and a completion it serves then is tagged with that version where the engine tags its
  answers (the embedded engine, as SGLang's `meta_info`; vLLM's carry none): rollouts tagged with another
  version are attributed to the wrong policy. While the held sync's session is open (`harness.mid_session`:
  after its first chunk, and before its finish), the engine still reports the version committed before it:
  only a finish commits one.
- `completions_in_session`: nothing is served from half-updated weights while an update session is open:
  an engine whose kind refuses completions then (the embedded engine's 409) refused the one asked of it,
  and one that serves between chunks (vLLM) had its generation paused by the sender (`/is_paused`), whose
  calls on the wire pause it before every start and resume it only after the finish answered.
- `engine_caches`: a probe prompt is served before a sync and again after it, without prompt log-probs
  (which skip vLLM's prefix cache, so they cannot see it); the generated token's log-prob after the sync
  must be what the expected state gives that token. A prefix cache that survived the update answers from
  keys/values of the old weights. (A vision-encoder cache that survived shows in the image prompt's
  log-probs, `logprobs.check_logprobs_expected`.) When the engine's reported checksums of that sync already
  differ from the expected state's, the message blames the weights, not a cache.
"""

from __future__ import annotations

from harness.checks.base import CheckResult, engine_reports_tensors, failed, oracle_failure, passed, skipped
from harness.record import HttpCall, RunRecord, SyncRecord

VERDICT = "PARITY_FAIL"
# Where the sender was held in an open session (`harness.mid_session.POINTS`), as a message says it.
WHEN = {
    "after_first_chunk": "its first chunk answered",
    "before_finish": "every chunk answered, the finish not yet sent",
}
REFUSALS = (409, 503)  # statuses that refuse a request for now: conflict (an open session), unavailable


def check_engine_fresh(record: RunRecord) -> CheckResult:
    """Before sync 0 the engine holds what a fresh engine of its checkpoint and seed holds (its seed's dummy
    weights, `oracles.fresh`), none of the checkpoint's bytes, and weight version 0 (engines that report
    per-tensor checksums)."""
    name = "engine_fresh"
    if not engine_reports_tensors(record):
        return skipped(name, VERDICT, "the engine reports no per-tensor checksums")
    why = oracle_failure(record, name)
    if why is not None:
        return skipped(name, VERDICT, why)
    if not record.engine_start_checksums:
        return skipped(name, VERDICT, "the engine's weights were not read before sync 0 (it did not run)")
    start = record.engine_start_checksums[0]
    total = len(record.checkpoint_checksums)
    same = [n for n, c in record.checkpoint_checksums.items() if start.get(n) == c]
    if same:
        return failed(
            name,
            VERDICT,
            f"before sync 0 the engine already held the checkpoint's bytes in {len(same)} of {total} tensors "
            f"(e.g. {same[0]!r}): sync 0 cannot show that the update moved them; start the engine from other "
            "weights (vLLM: --load-format dummy; embedded: an engine seed other than the checkpoint's)",
        )
    fresh = record.engine_fresh_checksums[0] if record.engine_fresh_checksums else {}
    stale = [n for n in start if n in fresh and start[n] != fresh[n]]
    if stale:
        return failed(
            name,
            VERDICT,
            f"before sync 0 the engine held other weights than a fresh engine of seed {record.scenario.engine_seed} "
            f"in {len(stale)} of {len(start)} tensors (e.g. {stale[0]!r}): it did not start fresh (an engine "
            "reused from an earlier scenario that kept its weights?), so an update that skips a tensor can pass",
        )
    version = record.engine_start_versions[0] if record.engine_start_versions else "0"
    if version != "0":
        return failed(
            name,
            VERDICT,
            f"before sync 0 the engine reports weight version {version!r}, not '0': it did not start fresh",
        )
    return passed(name, VERDICT)


def committed_before(record: RunRecord, sync: SyncRecord) -> str | None:
    """The weight version the engine should report before `sync` finishes: the last earlier finished sync's,
    else the one it reported before sync 0 (None when neither is known)."""
    earlier = [s for s in record.syncs if s.index < sync.index and s.finished]
    if earlier:
        return str(earlier[-1].weight_version)
    return record.engine_start_versions[0] if record.engine_start_versions else None


def check_weight_version(record: RunRecord) -> CheckResult:
    """After every finished sync the engine's committed weight version is that sync's, and so is the version
    its completions are tagged with, where they carry one; while a sync's session is open (`mid_session`),
    the engine still reports the version committed before it."""
    name = "weight_version"
    read = [s for s in record.syncs if s.engine_weight_version is not None]
    served = [s for s in record.syncs if s.finished and s.served_weight_version is not None]
    during = [
        (s, a, committed_before(record, s)) for s in record.syncs for a in s.mid_session if a.weight_version is not None
    ]
    if not read and not served and not during:
        return skipped(name, VERDICT, "the engine's weight version was not read back")
    wrong = [
        (
            s,
            f"the engine reports weight version {s.engine_weight_version!r} after finishing version "
            f"{str(s.weight_version)!r}",
        )
        for s in read
        if s.engine_weight_version != str(s.weight_version)
    ] + [
        (
            s,
            f"the engine's completions after finishing version {str(s.weight_version)!r} are tagged weight version "
            f"{s.served_weight_version!r} (it reports {s.engine_weight_version!r})",
        )
        for s in served
        if s.served_weight_version != str(s.weight_version)
    ]
    wrong += [
        (
            s,
            f"while its update session was open ({WHEN[a.point]}) the engine reported weight version "
            f"{a.weight_version!r}, not {before!r}, the version committed before it: a version committed before the "
            "update finished claims weights that are not all loaded, or not finished loading",
        )
        for s, a, before in during
        if before is not None and a.weight_version != before
    ]
    if wrong:
        s, what = wrong[0]
        return failed(name, VERDICT, f"sync {s.index}: {what}: its rollouts would be attributed to another policy")
    return passed(name, VERDICT)


def check_engine_caches(record: RunRecord) -> CheckResult:
    """After every sync the probe's generated token has, on the engine, the log-prob the expected state
    gives it (within the log-prob budget): no cache answered with the old weights."""
    name = "engine_caches"
    why = oracle_failure(record, name)
    if why is not None:
        return skipped(name, VERDICT, why)
    probed = [s for s in record.syncs if s.probe]
    budget = record.logprob_budget.get("max_abs")
    if not probed or budget is None:
        return skipped(name, VERDICT, "no probe served through the engine's caches")
    for s in probed:
        p = s.probe
        diff = abs(p["engine"] - p["expected"])
        if diff > budget:
            wrong = sorted(n for n, c in s.expected_checksums.items() if s.engine_checksums.get(n, c) != c)
            cause = (
                f"the engine's weights themselves differ from the expected state ({len(wrong)} "
                f"tensor{'s' if len(wrong) > 1 else ''}, e.g. "
                f"{wrong[0]!r}), so no cache is to blame for it yet"
                if wrong
                else "the weights match it, so a cache (prefix or encoder) or a copy of the weights the generation "
                "path keeps (a transposed lm_head, a fused buffer) answered with the old weights"
            )
            return failed(
                name,
                VERDICT,
                f"sync {s.index}: the probe prompt served again after the sync generated token {p['token']} with "
                f"log-prob {p['engine']:.6f} on the engine but {p['expected']:.6f} under the expected state "
                f"(|diff| {diff:.3g} > {budget:.3g}): {cause}",
            )
    return passed(name, VERDICT)


def pause_problem(record: RunRecord) -> str | None:
    """Where the engine serves requests between chunks (its `Capabilities.refuses_completions_in_session` is
    false, vLLM), what the sender's calls on the wire show of a sync run with its generation not paused: a
    `/start_weight_update` sent before any `/pause` was answered 200 in that sync, or a `/resume` sent after
    the start and before `/finish_weight_update` answered (a sync whose session the engine ended early has
    no finish: its resume is not early). None when nothing is wrong or the engine refuses on its own."""
    caps = record.engine_capabilities
    if caps is None or caps.refuses_completions_in_session:
        return None
    by_sync: dict[int, list[HttpCall]] = {}
    for call in record.http:
        if call.rank is not None and call.sync is not None:
            by_sync.setdefault(call.sync, []).append(call)
    for index, calls in sorted(by_sync.items()):
        start = next((c for c in calls if c.route == "/start_weight_update"), None)
        if start is None:
            continue
        if not any(c.route == "/pause" and c.status == 200 and c.t + c.ms / 1e3 <= start.t for c in calls):
            return f"sync {index}: /start_weight_update was sent with no /pause answered 200 before it"
        finish = next((c for c in calls if c.route == "/finish_weight_update"), None)
        if finish is None:
            continue
        end = finish.t + finish.ms / 1e3
        early = next((c for c in calls if c.route == "/resume" and start.t < c.t < end), None)
        if early is not None:
            return (
                f"sync {index}: /resume was sent {(end - early.t) * 1e3:.0f} ms before /finish_weight_update "
                "answered, with the session still open"
            )
    return None


def check_completions_in_session(record: RunRecord) -> CheckResult:
    """No request could be served from half-updated weights: where the engine serves between chunks (vLLM),
    every sync's calls on the wire pause its generation before the start and resume it only once the finish
    answered (`pause_problem`); and while the held sync's session was open (`mid_session`: the sender held
    after its first chunk and before its finish), an engine whose kind refuses completions then
    (`Capabilities.refuses_completions_in_session`) refused the one the harness asked for (409, or 503), and
    one that serves between chunks had its generation paused (`GET /is_paused` true)."""
    name = "completions_in_session"
    problem = pause_problem(record)
    if problem is not None:
        return failed(
            name,
            VERDICT,
            f"{problem}: this engine serves requests between chunks, so a rollout could run on half-updated "
            "weights (on vLLM 0.32 one killed the engine core); pause generation before /start_weight_update "
            "and resume it after the finish",
        )
    asked = [(s, a) for s in record.syncs for a in s.mid_session if a.completion is not None or a.paused is not None]
    if not asked:
        return skipped(name, VERDICT, "no completion or pause was asked while an update session was open")
    for s, a in asked:
        when = WHEN[a.point]
        if a.paused is False:
            return failed(
                name,
                VERDICT,
                f"sync {s.index}: the engine's generation was not paused while the update session was open "
                f"({when}), and this engine serves requests between chunks: a rollout then runs on half-updated "
                "weights (on vLLM 0.32 it killed the engine core, its layers not yet reloaded being on the meta "
                "device); POST /pause before /start_weight_update and /resume after the finish",
            )
        if a.completion == 200:
            return failed(
                name,
                VERDICT,
                f"sync {s.index}: the engine served a completion while the update session was open ({when}): a "
                "rollout from half-updated weights, tagged with a version it was not made by",
            )
        if a.completion is not None and a.completion not in REFUSALS:
            return failed(
                name,
                VERDICT,
                f"sync {s.index}: a completion asked while the update session was open ({when}) got {a.completion} "
                f"({a.note or 'no answer'}), not a refusal ({' or '.join(map(str, REFUSALS))})",
            )
    return passed(name, VERDICT)
