#!/bin/bash
# Behaviour unchanged? Runs every command on tiny checkpoints (GPT-2 and Llama, built here)
# with the working tree and with BEFORE (a commit, checked out into a temp worktree and put
# first on PYTHONPATH), and compares every CSV byte for byte.
#
#     scripts/same-results.sh BEFORE        e.g. scripts/same-results.sh 1610099
#
# Prints one line per CSV that differs or is missing, and exits 1 if any does. About 5
# minutes on 2 cores.
set -u
BEFORE=${1:?usage: scripts/same-results.sh COMMIT}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'git -C "$REPO" worktree remove --force "$WORK/before-tree" >/dev/null 2>&1; rm -rf "$WORK"' EXIT
git -C "$REPO" worktree add --detach "$WORK/before-tree" "$BEFORE" >/dev/null 2>&1 || {
    echo "error: cannot check out $BEFORE" >&2; exit 2; }
cd "$REPO" && python - "$WORK" <<'PY'
import sys
sys.path.insert(0, ".")
from blockscope.model.toy import save_gpt2_checkpoint
from tests.builders import save_checkpoint
save_gpt2_checkpoint(f"{sys.argv[1]}/tiny-gpt2", n_layer=3, n_embd=64, n_head=4,
                     n_positions=128, initializer_range=0.2)
save_checkpoint("llama", f"{sys.argv[1]}/tiny-llama", num_hidden_layers=3)
PY
M=$WORK/tiny-gpt2; L=$WORK/tiny-llama; A=$REPO/data/alice.txt
P="The capital of France is"; C="The capital of Italy is"

run_all() {  # $1: the folder for the results
    local O=$1
    r() { local name=$1; shift
          blockscope "$@" --out-dir "$O/$name" -q >"$O/$name.log" 2>&1 || echo "FAIL $name"; }
    mkdir -p "$O"
    r ablate ablate -t "$A" -m "$M" --max-tokens 200
    r ablate-mlp-mean ablate -t "$A" -m "$M" --max-tokens 100 --part mlp --method mean
    r ablate-llama ablate -t "$A" -m "$L" --max-tokens 100 --part attn
    r decompose ablate -t "$A" -m "$M" --max-tokens 60 --decompose
    r resid-norm resid-norm "$P" -m "$M"
    r prune-heads prune-heads -t "$A" -m "$M" --max-tokens 60 --step 0.25
    r prune-blocks prune-blocks -t "$A" -m "$M" --max-tokens 60
    r rearrange rearrange -t "$A" -m "$M" --max-tokens 60 --swap 0,2
    r logit-lens logit-lens "$P" -m "$M"
    r mlp-memory mlp-memory "$P" -m "$M"
    r head-roles head-roles -m "$M"
    r attention attention "$P" -m "$M"
    r shapes shapes "$P" -m "$M"
    r patch patch --clean "$P" --corrupted "$C" --target " Paris" --contrast " Rome" -m "$M" \
        --site resid-pre --site z --site mlp-out
    r patch-llama patch --clean "$P" --corrupted "$C" --target " Paris" -m "$L" \
        --site attn-out --site z
    r attribute attribute --clean "$P" --corrupted "$C" --target " Paris" --contrast " Rome" \
        -m "$M" --site resid-pre --site z --check 3
    r attribute-ig attribute --clean "$P" --corrupted "$C" --target " Paris" -m "$L" \
        --site mlp-out --method ig --ig-steps 3
    r attribute-edge attribute --clean "$P" --corrupted "$C" --target " Paris" -m "$M" \
        --contrast " Rome" --granularity edge --check 4
    r circuit circuit --clean "$P" --corrupted "$C" --target " Paris" --contrast " Rome" \
        -m "$L" --method atp
    r trace trace "$P" --subject France -m "$M" --samples 3
    r trace-llama trace "$P" --subject France -m "$L" --samples 2 --engine naive
    r knockout knockout "$P" --subject France -m "$M"
    r knockout-llama knockout "$P" --subject France -m "$L"
}

(export PYTHONPATH="$WORK/before-tree/src"; run_all "$WORK/before")
run_all "$WORK/after"
status=0
# a file's name ends in the settings' digest, which a new option (at its default) changes:
# files are matched by their name without it
bare() { sed -E 's/-[0-9a-f]{8}\.csv$/.csv/' <<< "$1"; }
for f in $(cd "$WORK/before" && find . -name '*.csv' | sort); do
    g=$(cd "$WORK/after" && for h in $(find "$(dirname "$f")" -name '*.csv' 2>/dev/null); do
        [ "$(bare "$h")" = "$(bare "$f")" ] && echo "$h"; done | head -1)
    if [ -z "$g" ]; then echo "missing after: $f"; status=1
    elif ! cmp -s "$WORK/before/$f" "$WORK/after/$g"; then echo "differs: $f"; status=1; fi
done
n=$(cd "$WORK/before" && find . -name '*.csv' | wc -l)
[ "$n" -gt 0 ] || { echo "error: no CSVs written before" >&2; exit 2; }
[ $status = 0 ] && echo "all $n CSVs equal byte for byte"
exit $status
