#!/usr/bin/env bash
# rl_check.sh — the RL driver data parallel over MPI (tide.rl.Recipe with dist.dp = N): tests/dist/rl_recipe.lua
# (recipes/agent_rl.lua in float64, with a reward that varies within every group and a PTX term) for an SFT warm-up
# and 3 iterations. dp = 2 and dp = 4 (mpirun, oversubscribed; 3 prompts, so a rank may sample or train nothing in
# an update) must give the one-process run: every weight and AdamW moment, every step's loss and every iteration's
# statistics within 1e-11 relative (the ranks' shares of each update's groups are summed in another order than one
# process's rows), for GRPO (the k3 KL to the saved reference, TIS, 2 updates per iteration), DAPO (dynamic sampling,
# the token-level mean over the whole step) and Kimi; the iteration's trajectories file (rank 0 writes every rank's
# samples) byte-identical to one process's; two dp = 2 runs bitwise alike; resuming a dp = 2 run mid-RL under dp = 2
# bitwise the uninterrupted run, and on one rank equal to it; ZeRO-1 == unsharded; partial rollouts (rl.budget: each
# rank pauses at its share and resumes its own samples) bitwise run to run and across a resume; dist.ep is one clear
# error. Usage: tests/dist/rl_check.sh [BUILD_DIR]
who=rl_check
source "$(dirname "$0")/setup.sh"
cmp() { "$tide" run tests/dist/dp_compare.lua --a="$1" --b="$2" --what="$3" --rl=true ${4:+--rel=$4}; }
base=(tests/dist/rl_recipe.lua --sft.steps=4 --sft.rows=6 --rl.iterations=3 --rl.prompts=3 --rl.G=4 --rl.max_new=24
      --train.quiet=true --train.ckpt_every=2)
grpo=(--rl.objective=grpo --rl.beta_kl=0.04 --rl.tis=true --rl.updates=2)
one() { "$tide" run "${base[@]}" "$@" > /dev/null 2>&1 || { echo "FAIL one rank: $*"; "$tide" run "${base[@]}" "$@" 2>&1 | tail -5; exit 1; }; }
par() { local n=$1; shift; "${mp[@]}" -np "$n" "$tide" run "${base[@]}" "$@" > "$tmp/last.log" 2>&1 \
          || { echo "FAIL dp $n: $*"; grep -v '^\[' "$tmp/last.log" | tail -5; exit 1; }; }
# resume_dir SRC DST STEP: a run directory holding SRC's checkpoint of STEP (and its config, reference, metrics)
resume_dir() {
    mkdir -p "$2/ckpt"
    cp -r "$1/ckpt/step_$3" "$2/ckpt/" && echo "step_$3" > "$2/ckpt/latest"
    cp "$1/config.json" "$1/metrics.jsonl" "$2/"
    if [ -d "$1/reference" ]; then cp -r "$1/reference" "$2/"; fi
}
one "${grpo[@]}" --out="$tmp/g1"
par 2 "${grpo[@]}" --out="$tmp/g2" --train.quiet=false
grep -q "data parallel over 2 ranks" "$tmp/last.log" || { echo "FAIL the dp 2 run does not say it is data parallel"; exit 1; }
cmp "$tmp/g1" "$tmp/g2" "grpo (KL, TIS, 2 updates, PTX): dp 2 == one process" 1e-11
grep -q '"grad_norm":0,' "$tmp/g1/metrics.jsonl" && { echo "FAIL an RL update with a zero gradient: the test sees no policy gradient"; exit 1; }
for f in "$tmp"/g1/trajectories/*.jsonl; do
    command cmp -s "$f" "$tmp/g2/trajectories/$(basename "$f")" \
        || { echo "FAIL dp 2's trajectories $(basename "$f") differ from one process's"; exit 1; }
done
echo "ok   dp 2's trajectory files (rank 0 writes every rank's samples) are one process's, byte for byte"
par 4 "${grpo[@]}" --out="$tmp/g4"
cmp "$tmp/g1" "$tmp/g4" "grpo: dp 4 == one process (3 prompts: a rank samples nothing)" 1e-11
par 2 "${grpo[@]}" --out="$tmp/g2b"
cmp "$tmp/g2" "$tmp/g2b" "grpo: two dp 2 runs"
# (DAPO without more rounds: this recipe's groups all differ in reward and none has mixed verdicts, so each
# iteration would draw max_resample more rounds; the flat case below draws them)
for obj in dapo kimi; do
    extra=()
    [ "$obj" = dapo ] && extra=(--rl.max_resample=0)
    one --rl.objective=$obj "${extra[@]}" --out="$tmp/$obj-1"
    par 2 --rl.objective=$obj "${extra[@]}" --out="$tmp/$obj-2"
    cmp "$tmp/$obj-1" "$tmp/$obj-2" "$obj: dp 2 == one process" 1e-11
done
# DAPO's dynamic sampling drawing more rounds: recipes/agent_rl.lua's own rewards after a 4-step warm-up are all 0,
# so every group is flat and each iteration draws max_resample more rounds of prompts (shared out anew each round)
plain=(recipes/agent_rl.lua --model.dtype=f64 --sft.steps=4 --sft.rows=6 --rl.iterations=2 --rl.prompts=3 --rl.G=4
       --rl.max_new=24 --train.quiet=true --rl.objective=dapo --rl.max_resample=2)
"$tide" run "${plain[@]}" --out="$tmp/dyn-1" > /dev/null 2>&1 || { echo "FAIL one rank: ${plain[*]}"; exit 1; }
"${mp[@]}" -np 2 "$tide" run "${plain[@]}" --out="$tmp/dyn-2" > /dev/null 2>&1 || { echo "FAIL dp 2: ${plain[*]}"; exit 1; }
cmp "$tmp/dyn-1" "$tmp/dyn-2" "dapo, every group flat (3 rounds of prompts an iteration): dp 2 == one process" 1e-11
n=$(cat "$tmp"/dyn-2/trajectories/iter_000001.jsonl | wc -l)
[ "$n" = 36 ] || { echo "FAIL dynamic sampling drew $n samples in iteration 1, not 3 rounds x 3 prompts x 4"; exit 1; }
echo "ok   dynamic sampling under dp 2 drew its 3 rounds (36 samples in iteration 1's file)"
# resume mid-RL: the checkpoint of step 8 (after the warm-up's 4 steps, iteration 2 of 3 with 2 updates each)
resume_dir "$tmp/g2" "$tmp/gr" 00000008
par 2 "${grpo[@]}" --out="$tmp/gr" --resume="$tmp/gr/ckpt/step_00000008"
cmp "$tmp/g2" "$tmp/gr" "grpo: dp 2 resumed at iteration 2 == uninterrupted"
resume_dir "$tmp/g2" "$tmp/gr1" 00000008
one "${grpo[@]}" --out="$tmp/gr1" --resume="$tmp/gr1/ckpt/step_00000008"
cmp "$tmp/g2" "$tmp/gr1" "grpo: the dp 2 checkpoint resumed on one rank == dp 2 uninterrupted" 1e-11
par 2 "${grpo[@]}" --dist.zero=1 --out="$tmp/gz"
cmp "$tmp/g2" "$tmp/gz" "grpo: dp 2 with ZeRO-1 == unsharded"
# partial rollouts: each rank pauses at its share of the budget; the paused samples of every rank are in the
# checkpoint (each with its rank) and resume on that rank
budget=(--sft.steps=2 --sft.rows=4 --rl.iterations=4 --rl.prompts=2 --rl.budget=130 --rl.resume_mode=prefill)
par 2 "${budget[@]}" --out="$tmp/b2"
grep -q '"paused":[1-9]' "$tmp/b2/metrics.jsonl" || { echo "FAIL the budgeted run paused nothing"; exit 1; }
par 2 "${budget[@]}" --out="$tmp/b2b"
cmp "$tmp/b2" "$tmp/b2b" "partial rollouts: two dp 2 runs"
resume_dir "$tmp/b2" "$tmp/br" 00000003
par 2 "${budget[@]}" --out="$tmp/br" --resume="$tmp/br/ckpt/step_00000003"
cmp "$tmp/b2" "$tmp/br" "partial rollouts: dp 2 resumed at iteration 2 (8 paused samples in the checkpoint) == uninterrupted"
n=$(grep -o '"iteration":[0-9]*' "$tmp/br/metrics.jsonl" | wc -l)
[ "$n" = 4 ] || { echo "FAIL the resumed run's metrics hold $n iteration records, not 4"; exit 1; }
echo "ok   the resumed run's metrics hold each of the 4 iterations once"
bad "an RL recipe runs data parallel only" "${mp[@]}" -np 2 "$tide" run "${base[@]}" --dist.ep=2 --out="$tmp/ep"
echo "ok   dist.ep under the RL driver: one clear error"
