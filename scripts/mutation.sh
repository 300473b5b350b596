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
#   scripts/mutation.sh --help
#
# Runs from a clean clone after scripts/setup.sh (cosmic-ray is in the [dev] extra).
# The core's hot modules run from source (KVTIER_PURE_PYTHON=1): a compiled
# extension would shadow the mutated .py. Output under .cache/mutation/<module>/:
# the session database, summary.txt (the figures) and survivors.txt (the diffs).
# Slow (seconds per mutant, hundreds of mutants per module): not for CI on every push.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${KVTIER_VENV:-.venv}  # another venv with kvtier and cosmic-ray installed, if not the clone's own
py=$venv/bin/python
out=.cache/mutation

# module -> "source file(s) | per-test-run timeout (s) | fast test selection"
declare -A MODULES=(
  [keys]="kvtier/keys.py|60|tests/core/test_keys.py"
  [radix]="kvtier/radix.py|120|tests/core/test_radix.py"
  [admission]="kvtier/admission.py|120|tests/core/test_admission.py"
  [peer_auth]="sidecar/kvtier_sidecar/peer_keys.py|120|tests/sidecar/test_peer_security.py::test_proofs_bind_role_nonces_endpoint_and_identity tests/sidecar/test_peer_security.py::test_keyring_accepts_the_previous_secret_only_during_the_overlap tests/sidecar/test_peer_security.py::test_secret_file_watch_rotates_on_a_changed_file_and_ignores_an_empty_one tests/sidecar/test_peer_security.py::test_secret_file_watch_survives_a_missing_file_and_one_it_cannot_read tests/sidecar/test_peer_security.py::test_a_servers_own_proof_reflected_back_is_refused tests/sidecar/test_peer_security.py::test_relayed_handshake_through_a_fake_peer_reads_nothing tests/sidecar/test_peer_transport.py::test_wrong_secret_gets_nothing_and_sends_no_request"
  [control_auth]="sidecar/kvtier_sidecar/control_auth.py|180|tests/sidecar/test_control_auth.py"
  [rollout]="operator/kvtier_operator/rollout.py|120|tests/operator/test_rollout_planner.py tests/operator/test_rollout_analysis.py tests/operator/test_graceful_leave_planners.py"
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

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

field() { cut -d'|' -f"$2" <<<"${MODULES[$1]}"; }

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --list)
    for m in "${ORDER[@]}"; do printf '%-13s %s\n    tests: %s\n' "$m" "$(field "$m" 1)" "$(field "$m" 3)"; done
    exit 0 ;;
esac
recheck=
if [ "${1:-}" = "--recheck" ]; then recheck=1; shift; fi
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

# Figures of a module's session (operators left out by EXCLUDE_OPERATORS are not
# mutants of this run; a mutant whose tests could not run is "incompetent" and not
# counted); with "recheck", first re-test the survivors against the tests as they
# are now (tests only ever added: a killed mutant stays killed) and record them.
summarize() {
  $py - "$out/$1" "$1" "$2" "$3" "${4:-}" <<'PYEOF'
import sys
import time
from pathlib import Path

from cosmic_ray.config import load_config
from cosmic_ray.mutating import mutate_and_test
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import MutationSpec, TestOutcome, WorkerOutcome

dir_, name, src, seconds, mode = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
with use_db(f"{dir_}/session.sqlite", WorkDB.Mode.open) as db:
    rechecked, began = 0, time.monotonic()
    if mode == "recheck":
        cfg = load_config(f"{dir_}/config.toml")
        for item, result in list(db.completed_work_items):
            if result.test_outcome is TestOutcome.SURVIVED:
                m = item.mutations[0]
                spec = MutationSpec(Path(m.module_path), m.operator_name, m.occurrence, m.start_pos, m.end_pos)
                db.set_result(item.job_id, mutate_and_test([spec], cfg.test_command, cfg.timeout))
                rechecked += 1
    killed, survived, incompetent = 0, [], 0
    for item, result in db.completed_work_items:
        if result.worker_outcome is WorkerOutcome.SKIPPED:
            continue
        if result.test_outcome is TestOutcome.SURVIVED:
            m = item.mutations[0]
            survived.append(f"--- {item.job_id} {m.operator_name} #{m.occurrence} line {m.start_pos[0]}\n{result.diff}")
        elif result.test_outcome is TestOutcome.INCOMPETENT:
            incompetent += 1
        else:
            killed += 1
    pending = sum(1 for _ in db.pending_work_items)
total = killed + len(survived)
rate = 100.0 * killed / total if total else 0.0
summary = (f"{name} {src}: killed {killed}/{total} ({rate:.1f}%), survived {len(survived)}, "
           f"incompetent {incompetent} (not counted), not run {pending}"
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

for m in "${mods[@]}"; do
  src=$(field "$m" 1) timeout_s=$(field "$m" 2) tests=$(field "$m" 3)
  dir="$out/$m"
  if [ -n "$recheck" ]; then
    [ -f "$dir/session.sqlite" ] || { echo "[mutation] $m: no earlier run to recheck" >&2; exit 1; }
    key=$(echo "$src" | tr '/' '_')
    cp "$src" "$backup/$key" && echo "$src" > "$backup/$key.path"
    write_config "$dir" "$src" "$timeout_s" "$tests"
    start=$(date +%s)
    summarize "$m" "$src" "$(( $(date +%s) - start ))" recheck
    continue
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  key=$(echo "$src" | tr '/' '_')
  cp "$src" "$backup/$key" && echo "$src" > "$backup/$key.path"
  write_config "$dir" "$src" "$timeout_s" "$tests"
  start=$(date +%s)
  echo "[mutation] $m: $src against $tests"
  # The unmutated tests must pass first, or every mutant would read as killed.
  if ! $py -m pytest -x -q -p no:cacheprovider $tests > "$dir/baseline.log" 2>&1; then
    echo "[mutation] $m: the tests fail without any mutant (see $dir/baseline.log)" >&2
    exit 1
  fi
  $venv/bin/cosmic-ray init "$dir/config.toml" "$dir/session.sqlite" > "$dir/init.log" 2>&1
  $venv/bin/cr-filter-operators "$dir/session.sqlite" "$dir/config.toml" >> "$dir/init.log" 2>&1
  $venv/bin/cosmic-ray exec "$dir/config.toml" "$dir/session.sqlite" > "$dir/exec.log" 2>&1
  cmp -s "$backup/$key" "$src" || { echo "[mutation] $m: $src was left mutated; restored" >&2; cp "$backup/$key" "$src"; }
  summarize "$m" "$src" "$(( $(date +%s) - start ))"
done
