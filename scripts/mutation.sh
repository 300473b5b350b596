#!/usr/bin/env bash
# Mutation testing of the modules where a silent bug costs most, with cosmic-ray:
# each module's source is mutated in place, one small change at a time, and the
# module's FAST unit tests run against each mutant; a mutant no test fails on
# "survived". Records killed/total and every survivor's diff. docs/MUTATION.md
# has the figures and what each survivor means.
#
#   scripts/mutation.sh --list          the modules and the tests each one runs
#   scripts/mutation.sh [module...]     run them (default: all), one at a time
#   scripts/mutation.sh --recheck module...  re-test only the last run's survivors
#                                       (after adding tests), and update its figures
#   scripts/mutation.sh --resume module...   go on with a run that was stopped
#   scripts/mutation.sh --help
#
# Runs from a clean clone after scripts/setup.sh (cosmic-ray is in the [dev] extra).
# The core's hot modules run from source (KVTIER_PURE_PYTHON=1): a compiled
# extension would shadow the mutated .py (checked before each module's run).
# Equivalent mutants are marked, not deleted: a line ending `# pragma: no mutate`
# (cosmic-ray's cr-filter-pragma) and operators inside annotations
# (scripts/mutation_filters.py); the figures give the raw kill rate and the rate
# with the marked ones left out. Output under .cache/mutation/<module>/: the session
# database, summary.txt (the figures) and survivors.txt (the diffs).
# Slow (seconds per mutant, hundreds of mutants per module): not for CI on every push.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${KVTIER_VENV:-.venv}  # another venv with kvtier and cosmic-ray installed, if not the clone's own
py=$venv/bin/python
out=.cache/mutation

# module -> "source file | least per-mutant timeout (s) | fast test selection [| the
# functions measured, when not the whole module]"; a mutant's
# tests get the larger of that and TIMEOUT_FACTOR times the unmutated run (a mutant
# that loops forever is killed by the timeout: cosmic-ray counts it killed).
TIMEOUT_FACTOR=5
declare -A MODULES=(
  [keys]="kvtier/keys.py|60|tests/core/test_keys.py"
  [radix]="kvtier/radix.py|30|tests/core/test_radix.py tests/core/test_radix_match.py|Match.last_hash PrefixIndex.match PrefixIndex.match_after PrefixIndex._walk PrefixIndex.truncate PrefixIndex.pin PrefixIndex.unpin PrefixIndex.slots_to PrefixIndex.hashes_to PrefixIndex.path PrefixIndex.prefix_tokens PrefixIndex._split _equal_prefix_blocks"
  [admission]="kvtier/admission.py|40|tests/core/test_admission.py"
  [peer_auth]="sidecar/kvtier_sidecar/peer_keys.py|120|tests/sidecar/test_peer_security.py::test_proofs_bind_role_nonces_endpoint_and_identity tests/sidecar/test_peer_security.py::test_keyring_accepts_the_previous_secret_only_during_the_overlap tests/sidecar/test_peer_security.py::test_secret_file_watch_rotates_on_a_changed_file_and_ignores_an_empty_one tests/sidecar/test_peer_security.py::test_secret_file_watch_survives_a_missing_file_and_one_it_cannot_read tests/sidecar/test_peer_security.py::test_a_servers_own_proof_reflected_back_is_refused tests/sidecar/test_peer_security.py::test_relayed_handshake_through_a_fake_peer_reads_nothing tests/sidecar/test_peer_transport.py::test_wrong_secret_gets_nothing_and_sends_no_request"
  [control_auth]="sidecar/kvtier_sidecar/control_auth.py|45|tests/sidecar/test_control_auth_rules.py"
  [rollout]="operator/kvtier_operator/rollout.py|120|tests/operator/test_rollout_planner.py tests/operator/test_rollout_planner_edges.py tests/operator/test_rollout_analysis.py tests/operator/test_graceful_leave_planners.py"
  [analysis]="operator/kvtier_operator/analysis.py|60|tests/operator/test_rollout_analysis.py tests/operator/test_rollout_planner.py"
  [netpol]="operator/kvtier_operator/netpol.py|60|tests/operator/test_network_policy_written.py::test_a_selector_by_expressions_is_rendered_whole_in_the_pod_selector_and_the_peer_rule tests/operator/test_network_policy_written.py::test_the_rendered_policy_is_exactly_the_three_rules_and_leaves_nothing_out tests/operator/test_network_policy_written.py::test_other_port_ranges_keep_the_last_port_and_merge_nothing_across_a_closed_one tests/operator/test_network_policy_written.py::test_sidecar_access_is_a_value_that_cannot_change_under_the_policy_rendered_from_it tests/helm/test_network_policy.py::test_other_port_ranges_cover_every_port_but_the_sidecars"
  [plan]="connector/kvtier_vllm/plan.py|120|tests/vllm/test_plan.py"
)
ORDER=(keys radix admission peer_auth control_auth rollout analysis netpol plan)

# One mutant per operator site, as mutmut and most tools do (cosmic-ray's default
# replaces each binary operator by every other one and each comparison by six):
# + <-> -, * <-> /, // -> *, % -> //, ** -> *, << <-> >>, | <-> &, ^ -> |;
# < <-> <=, > <-> >=, == <-> !=, is <-> is not; unary - -> +, dropped not / ~.
# Random variable replacement/insertion and decorator removal are left out.
EXCLUDE_OPERATORS='[
  "core/ReplaceBinaryOperator_(?!(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul|Mod_FloorDiv|Pow_Mul|LShift_RShift|RShift_LShift|BitOr_BitAnd|BitAnd_BitOr|BitXor_BitOr)$)",
  "core/ReplaceComparisonOperator_(?!(Eq_NotEq|NotEq_Eq|Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Is_IsNot|IsNot_Is)$)",
  "core/ReplaceUnaryOperator_(?!(USub_UAdd|Delete_Not|Delete_Invert)$)",
  "core/VariableReplacer", "core/VariableInserter", "core/RemoveDecorator"
]'

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; }

field() { cut -d'|' -f"$2" <<<"${MODULES[$1]}"; }
# The import name of a source file: kvtier/radix.py -> kvtier.radix,
# sidecar/kvtier_sidecar/peer_keys.py -> kvtier_sidecar.peer_keys.
module_name() {
  local p=${1%.py}
  case "$p" in kvtier/*) ;; *) p=${p#*/} ;; esac
  echo "${p//\//.}"
}

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --list)
    for m in "${ORDER[@]}"; do
      printf '%-13s %s\n    tests: %s\n' "$m" "$(field "$m" 1)" "$(field "$m" 3)"
      [ -z "$(field "$m" 4)" ] || printf '    only: %s\n' "$(field "$m" 4)"
    done
    exit 0 ;;
esac
recheck= resume=
if [ "${1:-}" = "--recheck" ]; then recheck=1; shift; fi
if [ "${1:-}" = "--resume" ]; then resume=1; shift; fi
mods=("$@")
[ ${#mods[@]} -gt 0 ] || mods=("${ORDER[@]}")
for m in "${mods[@]}"; do
  [ -n "${MODULES[$m]:-}" ] || { echo "unknown module '$m'; one of: ${ORDER[*]}" >&2; exit 2; }
done
[ -x "$venv/bin/cosmic-ray" ] || { echo "cosmic-ray missing from $venv: run scripts/setup.sh" >&2; exit 1; }
export KVTIER_PURE_PYTHON=1

# The cosmic-ray configuration of one module (its tests as the list above has them now).
write_config() {
  cat > "$1/config.toml" <<EOF
[cosmic-ray]
module-path = "$2"
timeout = $3
excluded-modules = []
test-command = "$py -m pytest -x -q -p no:cacheprovider $4"

[cosmic-ray.distributor]
name = "local"

[cosmic-ray.filters.operators-filter]
exclude-operators = $EXCLUDE_OPERATORS
EOF
}

# Figures of a module's session. Operators left out by EXCLUDE_OPERATORS, and the
# functions outside a module's measured ones, are not mutants of this run; a mutant whose tests could not run is "incompetent" and not
# counted; a mutant marked equivalent (a `# pragma: no mutate` line, an annotation)
# is counted as a survivor in the raw rate and left out of the other. With "recheck",
# first re-test the survivors against the tests as they are now (tests only ever
# added: a killed mutant stays killed) and record them.
summarize() {
  $py - "$out/$1" "$1" "$2" "$3" "${4:-}" "$only" <<'PYEOF'
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, "scripts")
from mutation_filters import EQUIVALENT_OUTPUT, LISTED_OUTPUT, function_spans

from cosmic_ray.config import load_config
from cosmic_ray.mutating import mutate_and_test
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import MutationSpec, TestOutcome, WorkerOutcome

dir_, name, src, seconds, mode = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
only = sys.argv[6].split()
scope = [function_spans(Path(src))[f] for f in only]
in_scope = lambda m: not scope or any(a <= tuple(m.start_pos) and tuple(m.end_pos) <= b for a, b in scope)
cfg = load_config(f"{dir_}/config.toml")
excluded = re.compile("|".join(f"(:?{e})" for e in cfg.sub("filters", "operators-filter")["exclude-operators"]))
with use_db(f"{dir_}/session.sqlite", WorkDB.Mode.open) as db:
    rechecked, began = 0, time.monotonic()
    if mode == "recheck":
        for item, result in list(db.completed_work_items):
            if result.test_outcome is TestOutcome.SURVIVED and in_scope(item.mutations[0]):
                m = item.mutations[0]
                spec = MutationSpec(Path(m.module_path), m.operator_name, m.occurrence, m.start_pos, m.end_pos)
                db.set_result(item.job_id, mutate_and_test([spec], cfg.test_command, cfg.timeout))
                rechecked += 1
    killed, timeouts, survived, marked, incompetent = 0, 0, [], {"pragma": 0, "annotation": 0, "listed": 0}, 0
    for item, result in db.completed_work_items:
        m = item.mutations[0]
        if not in_scope(m):
            continue  # the functions not measured (mutation_filters.py --only)
        if result.worker_outcome is WorkerOutcome.SKIPPED:
            if result.output == EQUIVALENT_OUTPUT:
                marked["annotation"] += 1
            elif result.output == LISTED_OUTPUT:
                marked["listed"] += 1
            elif result.output is None and not excluded.match(m.operator_name):
                marked["pragma"] += 1  # cr-filter-pragma's mark (it also re-marks excluded operators)
            continue
        if result.test_outcome is TestOutcome.SURVIVED:
            survived.append(f"--- {item.job_id} {m.operator_name} #{m.occurrence} line {m.start_pos[0]}\n{result.diff}")
        elif result.test_outcome is TestOutcome.INCOMPETENT:
            incompetent += 1
        else:
            killed += 1
            timeouts += result.output == "timeout"
    pending = sum(1 for i in db.pending_work_items if in_scope(i.mutations[0]))
equivalent = sum(marked.values())
counted = killed + len(survived)
raw_total = counted + equivalent
pct = lambda a, b: 100.0 * a / b if b else 0.0
summary = (f"{name} {src}: raw killed {killed}/{raw_total} ({pct(killed, raw_total):.1f}%); "
           f"without the {equivalent} marked equivalent ({marked['pragma']} pragma, {marked['annotation']} annotation, {marked['listed']} listed) "
           f"killed {killed}/{counted} ({pct(killed, counted):.1f}%), survived {len(survived)}; "
           f"{timeouts} of the killed by the {cfg.timeout:.0f} s timeout, incompetent {incompetent} (not counted), "
           f"not run {pending}"
           + (f"; {rechecked} survivors of the last run rechecked in {time.monotonic() - began:.0f} s"
              if mode == "recheck" else f", {seconds} s"))
open(f"{dir_}/summary.txt", "w").write(summary + "\n")
open(f"{dir_}/survivors.txt", "w").write("\n".join(survived) + ("\n" if survived else ""))
print(f"[mutation] {summary}")
PYEOF
}

# A mutated source must never outlive the run, whatever stops it.
backup=$(mktemp -d)
restore() {
  for f in "$backup"/*; do
    [ -e "$f" ] || continue
    target=$(cat "$f.path" 2>/dev/null) || continue
    cmp -s "$f" "$target" || cp "$f" "$target"
  done
  rm -rf "$backup"
}
trap restore EXIT
trap "exit 130" INT TERM

# Mark the session's pending mutants (left-out operators, marked equivalents, the
# functions not measured) and test the rest; a stopped run goes on from where it was.
run_mutants() {
  $venv/bin/cr-filter-pragma "$dir/session.sqlite" >> "$dir/init.log" 2>&1  # every item on such a line
  $venv/bin/cr-filter-operators "$dir/session.sqlite" "$dir/config.toml" >> "$dir/init.log" 2>&1
  $py scripts/mutation_filters.py "$dir/session.sqlite" ${only:+--only $only} >> "$dir/init.log" 2>&1
  $venv/bin/cosmic-ray exec "$dir/config.toml" "$dir/session.sqlite" >> "$dir/exec.log" 2>&1
  cmp -s "$backup/$key" "$src" || { echo "[mutation] $m: $src was left mutated; restored" >&2; cp "$backup/$key" "$src"; }
}

for m in "${mods[@]}"; do
  src=$(field "$m" 1) timeout_s=$(field "$m" 2) tests=$(field "$m" 3) only=$(field "$m" 4)
  dir="$out/$m"
  if [ -n "$resume" ]; then
    [ -f "$dir/session.sqlite" ] || { echo "[mutation] $m: no earlier run to resume" >&2; exit 1; }
    key=$(echo "$src" | tr '/' '_')
    cp "$src" "$backup/$key" && echo "$src" > "$backup/$key.path"
    write_config "$dir" "$src" "$(cat "$dir/timeout" 2>/dev/null || echo "$timeout_s")" "$tests"
    start=$(date +%s)
    echo "[mutation] $m: resuming"
    run_mutants
    summarize "$m" "$src" "$(( $(date +%s) - start ))"
    continue
  fi
  if [ -n "$recheck" ]; then
    [ -f "$dir/session.sqlite" ] || { echo "[mutation] $m: no earlier run to recheck" >&2; exit 1; }
    key=$(echo "$src" | tr '/' '_')
    cp "$src" "$backup/$key" && echo "$src" > "$backup/$key.path"
    write_config "$dir" "$src" "$(cat "$dir/timeout" 2>/dev/null || echo "$timeout_s")" "$tests"
    # pragmas and listed equivalents added since
    $venv/bin/cr-filter-pragma "$dir/session.sqlite" >> "$dir/init.log" 2>&1
    $venv/bin/cr-filter-operators "$dir/session.sqlite" "$dir/config.toml" >> "$dir/init.log" 2>&1
    $py scripts/mutation_filters.py "$dir/session.sqlite" ${only:+--only $only} >> "$dir/init.log" 2>&1
    start=$(date +%s)
    summarize "$m" "$src" "$(( $(date +%s) - start ))" recheck
    continue
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  key=$(echo "$src" | tr '/' '_')
  cp "$src" "$backup/$key" && echo "$src" > "$backup/$key.path"
  start=$(date +%s)
  echo "[mutation] $m: $src against $tests"
  # The mutated file must be the one the tests import (not a compiled extension, not
  # another checkout's copy), or every mutant would read as survived.
  if ! $py -c 'import importlib, pathlib, sys
mod = importlib.import_module(sys.argv[1])
sys.exit(pathlib.Path(mod.__file__).resolve() != pathlib.Path(sys.argv[2]).resolve() and f"imports {mod.__file__}")' \
      "$(module_name "$src")" "$src" 2> "$dir/import.log"; then
    echo "[mutation] $m: the tests would not run $src: $(cat "$dir/import.log")" >&2
    exit 1
  fi
  # The unmutated tests must pass first, or every mutant would read as killed.
  t0=$(date +%s)
  if ! $py -m pytest -x -q -p no:cacheprovider $tests > "$dir/baseline.log" 2>&1; then
    echo "[mutation] $m: the tests fail without any mutant (see $dir/baseline.log)" >&2
    exit 1
  fi
  base_s=$(( $(date +%s) - t0 + 1 ))
  timeout_s=$(( base_s * TIMEOUT_FACTOR > timeout_s ? base_s * TIMEOUT_FACTOR : timeout_s ))
  echo "$timeout_s" > "$dir/timeout"
  echo "[mutation] $m: unmutated tests took ${base_s} s; per-mutant timeout ${timeout_s} s"
  write_config "$dir" "$src" "$timeout_s" "$tests"
  $venv/bin/cosmic-ray init "$dir/config.toml" "$dir/session.sqlite" > "$dir/init.log" 2>&1
  run_mutants
  summarize "$m" "$src" "$(( $(date +%s) - start ))"
done
