#!/usr/bin/env bash
# Model-check tract's global lock protocols with spin: the bakery
# (model/bakery.pml), the manager with sticky grants (model/manager.pml), and
# the manager as tract/lock.py implements it (model/manager_impl.pml), on the
# non-coherent memory model of model/memory.pml.
#
# Every check builds its own pan in a scratch directory, runs it, and must end
# as expected: "pass" (errors: 0 over the whole state space) for the correct
# models, or "refute" (spin finds the named counter-example) for the
# deliberately broken variants.  One summary line per check; exit 1 if any
# check ends otherwise, 2 if spin (or a C compiler) is missing.
#
# Environment: MODEL_JOBS (checks run at once; default: 2, or 1 on a
# 1-CPU machine), MODEL_ONLY / MODEL_SKIP (grep -E patterns on check names:
# run only those / leave those out; MODEL_SKIP='-n3$' leaves out the two
# longest checks), MODEL_TIMEOUT (seconds per verifier, default 900),
# MODEL_KEEP=1 (keep the scratch directory and print its path),
# MODEL_FRESH=1 (verify every check again, whatever the cache holds).  All
# checks: about 3 minutes on 2 idle cores, 2.5 GB per job at most.
#
# A check that ended as expected is remembered under
# ${XDG_CACHE_HOME:-~/.cache}/tract/model, keyed by everything its verdict
# depends on: its line below, every model file, this script, and the
# versions of spin and the C compiler.  The same check with the same key is
# the same proof, so it is not run again; its line says "(cached)".  Any
# change to a model, a flag or a tool is a new key, and a check that failed
# is never remembered.
set -euo pipefail

CC=${CC:-gcc}

if ! command -v spin >/dev/null 2>&1; then
    echo "check.sh: spin is not installed (Debian/Ubuntu: apt-get install -y spin);" \
         "the model checks cannot run" >&2
    exit 2
fi
if ! command -v "$CC" >/dev/null 2>&1; then
    echo "check.sh: no C compiler ($CC) to build spin's verifier" >&2
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cpus=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
jobs=${MODEL_JOBS:-$(( cpus >= 2 ? 2 : 1 ))}
only=${MODEL_ONLY:-}
skip=${MODEL_SKIP:-}
limit=${MODEL_TIMEOUT:-900}   # seconds per verifier run

work=$(mktemp -d "${TMPDIR:-/tmp}/tract-model.XXXXXX")
cache=${XDG_CACHE_HOME:-$HOME/.cache}/tract/model
fresh=${MODEL_FRESH:-0}
# what every verdict depends on besides its own line
inputs=$( { cat "$here"/*.pml "${BASH_SOURCE[0]}"; spin -V; "$CC" --version; } | sha256sum | cut -c1-32)
if [[ "${MODEL_KEEP:-0}" == 1 ]]; then
    echo "check.sh: scratch directory $work"
else
    trap 'rm -rf "$work"' EXIT
fi

# One check.  Arguments:
#   name     unique, used for the scratch directory and the summary
#   model    bakery | manager | manager_impl (model/<model>.pml)
#   mode     safety   : pan compiled with -DSAFETY -DNOCLAIM; assertions and
#                       invalid end states
#            liveness : the model's ltl claim, ./pan -a -f (acceptance
#                       cycles under weak fairness); assertions checked too
#            liveness-A : the same with assertions off (-A)
#   expect   pass | refute:<extended regex the pan output must match>
#   key      the check's key in the cache (check_key)
#   flags... -D flags for spin (the model's configuration); cc:FLAG passes
#            FLAG to gcc instead (cc:-DCOLLAPSE: compressed state storage)
run_check() {
    local name=$1 model=$2 mode=$3 expect=$4 key=$5
    shift 5
    local dir="$work/$name"
    mkdir -p "$dir"
    # flags: -D... go to spin (the model's configuration), cc:-D... to gcc
    local spinflags=() ccflags=() flag
    for flag in "$@"; do
        case $flag in
            cc:*) ccflags+=("${flag#cc:}") ;;
            *) spinflags+=("$flag") ;;
        esac
    done
    local t0=$SECONDS
    local status=1 line
    (
        cd "$dir"
        local cflags=(-O2 -w) panflags=(-m1000000)
        case $mode in
            safety) cflags+=(-DSAFETY -DNOCLAIM) ;;
            liveness) panflags+=(-a -f) ;;
            liveness-A) panflags+=(-a -f -A) ;;
            *) echo "bad mode $mode" >&2; exit 1 ;;
        esac
        spin "${spinflags[@]}" -a "$here/$model.pml" >spin.out 2>&1 ||
            { echo "spin -a failed" >reason; exit 1; }
        "$CC" "${cflags[@]}" "${ccflags[@]}" -o pan pan.c >cc.out 2>&1 ||
            { echo "gcc failed" >reason; exit 1; }
        # a runaway verifier (a model change that blows up) ends as a FAIL
        timeout "$limit" ./pan "${panflags[@]}" >pan.out 2>&1 || true
    ) || true
    local out="$dir/pan.out"
    local secs=$(( SECONDS - t0 ))
    if [[ ! -s "$out" ]]; then
        line="FAIL  $name: $(cat "$dir/reason" 2>/dev/null || echo 'pan did not run') ($(cat "$dir/spin.out" "$dir/cc.out" 2>/dev/null | tail -3 | tr '\n' ' '))"
    else
        local errors states depth incomplete=""
        errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | tail -1)
        states=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$out" | tail -1)
        depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' "$out" | tail -1)
        if grep -qE "max search depth too small|Search not completed|out of memory" "$out" ||
            ! grep -q "elapsed time" "$out"; then
            incomplete=yes
        fi
        local stats="states=${states:-?} depth=${depth:-?} ${secs}s"
        case $expect in
            pass)
                # vacuity guard: every statement of every process must be
                # reachable, except the ends of endless loops, the crash
                # escape of bakery's nodes when no node crashes, and the
                # assert(0) that mark branches proven unreachable (with the
                # d_step entries of the same state)
                local unreached
                unreached=$(awk '
                    /^unreached in proctype/ { on = 1; proc = $4; next }
                    /^unreached in/ { on = 0 }
                    on && /\.pml:[0-9]+, state [0-9]+/ {
                        match($0, /state [0-9]+/)
                        key = proc ":" substr($0, RSTART, RLENGTH)
                        if ($0 ~ /"-end-"|"\(crashed\[i\]\)"|"assert\(0\)"/) ok[key] = 1
                        else { n++; line[n] = $0; keys[n] = key }
                    }
                    END { for (i = 1; i <= n; i++) if (!(keys[i] in ok)) print line[i] }
                    ' "$out" | head -3 | tr -s ' \t\n' ' ')
                if [[ "$errors" == 0 && -z "$incomplete" && -z "$unreached" ]]; then
                    status=0
                    line="ok    $name: verified (errors: 0, $stats)"
                elif [[ "$errors" == 0 && -z "$incomplete" ]]; then
                    line="FAIL  $name: errors: 0 but unreachable protocol code (vacuous?): $unreached"
                else
                    line="FAIL  $name: expected errors: 0, got errors: ${errors:-?}${incomplete:+ (search incomplete)} ($stats): $(grep -m1 -E 'violated|cycle|invalid end' "$out" || true)"
                fi
                ;;
            refute:*)
                local pattern=${expect#refute:}
                local found
                found=$(grep -m1 -E "$pattern" "$out" || true)
                if [[ -n "$errors" && "$errors" != 0 && -n "$found" ]]; then
                    status=0
                    line="ok    $name: refuted as expected (${found#pan:1: }; $stats)"
                else
                    line="FAIL  $name: expected a counter-example matching /$pattern/, got errors: ${errors:-?} ($stats)"
                fi
                ;;
        esac
    fi
    echo "$line" >"$dir/summary"
    echo "$status" >"$dir/status"
    if [[ $status == 0 ]]; then
        mkdir -p "$cache" && echo "$line" >"$cache/$key.part.$$" &&
            mv "$cache/$key.part.$$" "$cache/$key" || true  # the cache is only a speed-up
    fi
}

# The cache's key of one check: its line of the table and `inputs`.
check_key() {
    printf '%s\n%s\n' "$1" "$inputs" | sha256sum | cut -c1-32
}

# name | model | mode | expect | spin flags
# Longest checks first, so that two parallel jobs finish close together.
checks=(
    # The longest checks come first, so that parallel jobs finish together.
    # --- as implemented in tract/lock.py (commit 32bd86a), N=3 (the manager
    #     reads the request lines in a fixed order here; any order at N=2)
    "manager-impl-safety-n3|manager_impl|safety|pass|-DN=3 -DACQ=1 cc:-DCOLLAPSE"
    "bakery-impl-safety-n3|bakery|safety|pass|-DONE_FENCE -DN=3 -DACQ=1 cc:-DCOLLAPSE"
    # --- bakery as specified, reduced memory model, N=3 nodes, 2 acquisitions each
    "bakery-liveness|bakery|liveness|pass|"
    "bakery-safety|bakery|safety|pass|"
    "bakery-crash-liveness|bakery|liveness-A|pass|-DCRASH -DACQ=1"
    "bakery-broken-no-invalidate|bakery|safety|refute:assertion violated \\(incs<=1\\)|-DBROKEN_NO_INVALIDATE"
    "bakery-broken-no-choosing|bakery|safety|refute:assertion violated \\(incs<=1\\)|-DBROKEN_NO_CHOOSING"
    "bakery-broken-no-release-flush|bakery|liveness|refute:acceptance cycle|-DBROKEN_NO_RELEASE_FLUSH"
    # --- bakery, unreduced memory model (every operation a step, free env)
    "bakery-fullenv-liveness|bakery|liveness|pass|-DFULL_ENV -DN=2 -DACQ=2"
    "bakery-fullenv-safety|bakery|safety|pass|-DFULL_ENV -DN=2 -DACQ=2"
    "bakery-fullenv-broken-no-invalidate|bakery|safety|refute:assertion violated \\(incs<=1\\)|-DFULL_ENV -DN=2 -DBROKEN_NO_INVALIDATE"
    # --- bakery as implemented (one fence after each doorway half)
    "bakery-impl-safety|bakery|safety|pass|-DONE_FENCE -DN=2 -DACQ=2"
    "bakery-impl-liveness|bakery|liveness|pass|-DONE_FENCE -DN=2 -DACQ=2"
    "bakery-impl-broken-no-doorway-fresh|bakery|safety|refute:assertion violated \\(incs<=1\\)|-DONE_FENCE -DBROKEN_NO_DOORWAY_FRESH"
    # --- manager as specified, plus the two fixes, N=3 nodes, 2 acquisitions each
    "manager-liveness|manager|liveness|pass|"
    "manager-safety|manager|safety|pass|"
    "manager-split-safety|manager|safety|pass|-DGRANT_SPLIT -DACQ=1 -DACQ0=2"
    "manager-split-liveness|manager|liveness|pass|-DGRANT_SPLIT -DACQ=1 -DACQ0=2"
    "manager-as-specified-safety|manager|safety|pass|-DAS_SPECIFIED"
    "manager-as-specified-liveness|manager|liveness|refute:acceptance cycle|-DAS_SPECIFIED"
    "manager-broken-no-used-check|manager|safety|refute:assertion violated \\(mg_epoch<16\\)|-DBROKEN_NO_USED_CHECK"
    "manager-broken-no-used-check-liveness|manager|liveness-A|refute:acceptance cycle|-DBROKEN_NO_USED_CHECK"
    "manager-broken-no-revoking|manager|safety|refute:assertion violated \\(incs<=1\\)|-DBROKEN_NO_REVOKING -DNO_TOKEN_CHECK"
    "manager-broken-no-invalidate|manager|safety|refute:assertion violated \\(incs<=1\\)|-DBROKEN_NO_INVALIDATE -DNO_TOKEN_CHECK"
    "manager-broken-state-first|manager|safety|refute:assertion violated \\(incs<=1\\)|-DGRANT_SPLIT -DBROKEN_STATE_FIRST -DNO_TOKEN_CHECK"
    "manager-broken-torn-read|manager|safety|refute:assertion violated \\(incs<=1\\)|-DGRANT_SPLIT -DBROKEN_TORN_READ -DNO_TOKEN_CHECK"
    # --- manager, unreduced memory model, N=2 (node 0: 2 acquisitions)
    "manager-fullenv-safety|manager|safety|pass|-DFULL_ENV -DN=2 -DACQ=1 -DACQ0=2"
    "manager-fullenv-broken-no-revoking|manager|safety|refute:assertion violated \\(incs<=1\\)|-DFULL_ENV -DN=2 -DACQ=1 -DACQ0=2 -DBROKEN_NO_REVOKING -DNO_TOKEN_CHECK"
    # --- manager as implemented (wait_seq, check word), one live manager
    "manager-impl-liveness|manager_impl|liveness|pass|-DN=2 -DACQ=2 -DREAD_ANY_ORDER"
    "manager-impl-safety|manager_impl|safety|pass|-DN=2 -DACQ=2 -DREAD_ANY_ORDER"
    "manager-impl-broken-no-revoking|manager_impl|safety|refute:assertion violated \\(incs<=1\\)|-DN=2 -DREAD_ANY_ORDER -DBROKEN_NO_REVOKING -DNO_TOKEN_CHECK"
    "manager-impl-broken-no-say-waiting|manager_impl|liveness|refute:acceptance cycle|-DN=2 -DREAD_ANY_ORDER -DBROKEN_NO_SAY_WAITING"
    "manager-impl-broken-no-yet-to-use|manager_impl|liveness|refute:acceptance cycle|-DN=2 -DREAD_ANY_ORDER -DBROKEN_NO_YET_TO_USE"
)

start=$SECONDS
names=()
running=0
cached=0
for entry in "${checks[@]}"; do
    IFS='|' read -r name model mode expect flags <<<"$entry"
    if [[ -n "$only" ]] && ! grep -qE -- "$only" <<<"$name"; then
        continue
    fi
    if [[ -n "$skip" ]] && grep -qE -- "$skip" <<<"$name"; then
        continue
    fi
    names+=("$name")
    key=$(check_key "$entry")
    if [[ "$fresh" != 1 && -s "$cache/$key" ]]; then
        mkdir -p "$work/$name"
        echo "$(cat "$cache/$key") (cached)" >"$work/$name/summary"
        echo 0 >"$work/$name/status"
        cached=$(( cached + 1 ))
        continue
    fi
    # shellcheck disable=SC2086  # flags is a list of -D words
    run_check "$name" "$model" "$mode" "$expect" "$key" $flags &
    running=$(( running + 1 ))
    if (( running >= jobs )); then
        wait -n || true
        running=$(( running - 1 ))
    fi
done
wait || true

if (( ${#names[@]} == 0 )); then
    echo "check.sh: no check left (MODEL_ONLY=$only MODEL_SKIP=$skip)" >&2
    exit 1
fi

failed=0
for name in "${names[@]}"; do
    cat "$work/$name/summary" 2>/dev/null || echo "FAIL  $name: no result"
    if [[ "$(cat "$work/$name/status" 2>/dev/null || echo 1)" != 0 ]]; then
        failed=$(( failed + 1 ))
    fi
done
echo "check.sh: ${#names[@]} checks ($cached cached), $failed unexpected, $(( SECONDS - start ))s (spin $(spin -V | sed -n 's/Spin Version \([^ ]*\).*/\1/p'), $jobs jobs)"
(( failed == 0 ))
