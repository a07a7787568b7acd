#!/usr/bin/env bash
# dp_check.sh — data parallelism over MPI (DESIGN.md §9) against one rank: recipes/dense.lua, small and in f64 and
# f32, and a tiny hybrid MoE model (tests/dist/dp_moe.lua: QB exact and histogram, the sign rule), for 6 steps with a
# checkpoint; the 3-stage MoE curriculum of the tests (tests/fixtures/curriculum_small.lua) against itself on one rank. dp = 2 and dp = 4 (mpirun, oversubscribed) must give one rank's run with
# train.micro_batches = 2 / 4 (the same global batch): every weight, every AdamW moment and every loss bitwise, since
# the gradient sum runs in rank order like gradient accumulation; two dp = 2 runs bitwise alike; resuming a dp = 2
# run from its step-3 checkpoint (under dp = 2, and on one rank with 2 micro-batches) bitwise the uninterrupted run; a
# rank that raises or is SIGKILLed ends the job within a minute (the raise names its rank) and the checkpoint it leaves
# resumes to the uninterrupted run; ZeRO-1 and ZeRO-2 == unsharded (ZeRO-2 with fewer bytes); the sharded checkpoint layout (each rank its shards, the index files), `tide ckpt
# consolidate` of it (== the shards, and resumed on one rank == dp 2), a rank killed inside a save (the step never
# appears, latest stays); a parameter no rank's batch reached keeps no gradient (vlm_tiny's text-only and frozen
# stages); dist.dp that is not the number of ranks is one clear error. Usage: tests/dist/dp_check.sh [BUILD_DIR]
who=dp_check
source "$(dirname "$0")/setup.sh"
small=(--model.dim=32 --model.n_layers=2 --model.n_heads=2 --data.seq_len=32 --data.batch_size=8 --train.steps=6
       --train.eval_every=0 --train.ckpt_every=3 --train.log_every=1 --sample.max_new_tokens=0 --train.threads=1
       --schedule.warmup=2 --train.quiet=true)
# the process group's all-gather and all-to-all-v from Lua (expert parallelism dispatches with them)
for n in 2 4; do "${mp[@]}" -np $n "$tide" run tests/dist/dp_collectives.lua; done
cmp() { "$tide" run tests/dist/dp_compare.lua --a="$1" --b="$2" --what="$3"; }
for dt in f64 f32; do
    one() { "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=$dt "$@"; }
    one --train.micro_batches=2 --out="$tmp/$dt-m2" > /dev/null
    "${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=$dt --out="$tmp/$dt-dp2" > /dev/null
    cmp "$tmp/$dt-m2" "$tmp/$dt-dp2" "$dt: dp 2 == one rank, 2 micro-batches"
done
one() { "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 "$@"; }
# the comparison sees a change of summation order: one rank with 1 and with 2 micro-batches differ
one --out="$tmp/m1" > /dev/null
if "$tide" run tests/dist/dp_compare.lua --a="$tmp/m1" --b="$tmp/f64-m2" > /dev/null 2>&1; then
    echo "FAIL 1 and 2 micro-batches compare equal: the comparison cannot see a summation order"; exit 1; fi
echo "ok   1 and 2 micro-batches differ (the comparison sees the summation order)"
# the ranks really share the work: the run says so
out=$("${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --train.quiet=false --out="$tmp/say" 2>&1)
grep -q "data parallel over 2 ranks" <<< "$out" || { echo "FAIL the dp 2 run does not report 2 ranks: $out"; exit 1; }
# a text stream draws each row alone: a rank reads only its own rows (the comparisons above show they are the rows
# one rank with 2 micro-batches trains on)
grep -q "a rank reads only its rows of the stream" <<< "$out" || { echo "FAIL the dp 2 text run does not read disjoint rows: $out"; exit 1; }
grep -Eq "memory per rank measured: engine peak [0-9.]+ / [0-9.]+ MB" <<< "$out" \
    || { echo "FAIL the dp 2 run does not report each rank's measured peak: $out"; exit 1; }
echo "ok   dp 2 start-up and end lines: $(grep -m1 'memory per rank:' <<< "$out"); $(grep -m1 'memory per rank measured' <<< "$out")"
one --train.micro_batches=4 --out="$tmp/m4" > /dev/null
"${mp[@]}" -np 4 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --out="$tmp/dp4" > /dev/null
cmp "$tmp/m4" "$tmp/dp4" "f64: dp 4 == one rank, 4 micro-batches"
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --out="$tmp/dp2b" > /dev/null
cmp "$tmp/f64-dp2" "$tmp/dp2b" "f64: two dp 2 runs"
# resume: the step-3 checkpoint of a dp 2 run, continued under dp 2
mkdir -p "$tmp/res"
cp -r "$tmp/f64-dp2/ckpt" "$tmp/res/" && cp "$tmp/f64-dp2/config.json" "$tmp/res/"
head -3 "$tmp/f64-dp2/metrics.jsonl" > "$tmp/res/metrics.jsonl"
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --out="$tmp/res" \
    --resume="$tmp/res/ckpt/step_00000003" > /dev/null
cmp "$tmp/f64-dp2" "$tmp/res" "f64: dp 2 resumed at step 3 == uninterrupted"
# a parameter no rank's batch reached keeps no gradient, as on one rank: recipes/vlm_tiny.lua's text-only first stage
# leaves the vision tower unused and its align stage freezes the language model; were they given the zero sum, AdamW
# would decay them (weight decay) where one rank leaves them alone
vlm=(recipes/vlm_tiny.lua --scale=smoke --model.dtype=f64 --micro_tokens=1024)
"$tide" run "${vlm[@]}" --dist.lanes=2 --out="$tmp/vlm-one" > /dev/null
"${mp[@]}" -np 2 "$tide" run "${vlm[@]}" --out="$tmp/vlm-dp2" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/vlm-one" --b="$tmp/vlm-dp2" \
    --what="vlm f64: dp 2 through a text-only and a frozen stage == one rank with both lanes (bitwise)"

# gradient buckets summed while the backward runs (dist.bucket_mb; the runs above use the default 0, one sum after the
# backward): 0.05 MB cuts the dense model into 7 buckets, filled as the backward finishes their parameters and
# summed on the helper thread: == one rank bitwise at dp 2 and 4, and every bucket was full before the backward ended;
# 8 MB (one bucket here) too; bucket_mb = 0 sums after the backward (no bucket records)
for n in 2 4; do
    "${mp[@]}" -np $n "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.bucket_mb=0.05 --out="$tmp/bk$n" > /dev/null
    ref="$tmp/f64-m2"; [ $n = 4 ] && ref="$tmp/m4"
    cmp "$ref" "$tmp/bk$n" "f64: dp $n, gradients in 0.05 MB buckets during the backward == one rank, $n micro-batches"
done
grep -q '"dist/buckets":7' "$tmp/bk2/metrics.jsonl" && grep -q '"dist/buckets_early":7' "$tmp/bk2/metrics.jsonl" \
    || { echo "FAIL the bucketed run does not report 7 buckets full during the backward: $(head -1 "$tmp/bk2/metrics.jsonl")"; exit 1; }
echo "ok   dp 2, 0.05 MB buckets: 7 buckets, all 7 full before the backward ended (overlap share of the sum per step: $(grep -o '"dist/overlap":[0-9.e-]*' "$tmp/bk2/metrics.jsonl" | cut -d: -f2 | tr '\n' ' '))"
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.bucket_mb=8 --out="$tmp/bk8" > /dev/null
cmp "$tmp/f64-m2" "$tmp/bk8" "f64: dp 2, one 8 MB bucket == one rank"
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.bucket_mb=0 --out="$tmp/bk0" > /dev/null
cmp "$tmp/f64-m2" "$tmp/bk0" "f64: dp 2, one sum after the backward (bucket_mb = 0) == one rank"
! grep -q '"dist/buckets"' "$tmp/bk0/metrics.jsonl" || { echo "FAIL bucket_mb = 0 still reports buckets"; exit 1; }
# ZeRO-1 (dist.zero = 1: each rank owns the AdamW moments of its share of the parameters) == unsharded, bitwise; its
# checkpoint (each owner wrote its moments into its shard) resumed under dp 4 == one rank resuming the same step with 4 micro-batches
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=1 --out="$tmp/z2" > /dev/null
cmp "$tmp/f64-m2" "$tmp/z2" "f64: dp 2 with ZeRO-1 == one rank, 2 micro-batches"
"${mp[@]}" -np 4 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=1 --out="$tmp/z4" > /dev/null
cmp "$tmp/m4" "$tmp/z4" "f64: dp 4 with ZeRO-1 == one rank, 4 micro-batches"
for d in zres ref4; do
    mkdir -p "$tmp/$d"
    cp -r "$tmp/z2/ckpt" "$tmp/$d/" && cp "$tmp/z2/config.json" "$tmp/$d/"
    head -3 "$tmp/z2/metrics.jsonl" > "$tmp/$d/metrics.jsonl"
done
"$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --train.micro_batches=4 --out="$tmp/ref4" \
    --resume="$tmp/ref4/ckpt/step_00000003" > /dev/null
"${mp[@]}" -np 4 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=1 --out="$tmp/zres" \
    --resume="$tmp/zres/ckpt/step_00000003" > /dev/null
cmp "$tmp/ref4" "$tmp/zres" "f64: a dp 2 ZeRO-1 checkpoint resumed under dp 4 ZeRO-1 == one rank with 4 micro-batches"
# ZeRO-2 (dist.zero = 2: the gradients reduce-scattered in rank order, each owner keeps its sums, the global norm from
# every parameter's sum of squares): == one rank bitwise at dp 2 and dp 4, with fewer bytes than ZeRO-1; resumed
# from its own step-3 checkpoint under dp 2 ZeRO-2 == uninterrupted
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=2 --out="$tmp/zz2" > /dev/null
cmp "$tmp/f64-m2" "$tmp/zz2" "f64: dp 2 with ZeRO-2 == one rank, 2 micro-batches"
"${mp[@]}" -np 4 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=2 --out="$tmp/zz4" > /dev/null
cmp "$tmp/m4" "$tmp/zz4" "f64: dp 4 with ZeRO-2 == one rank, 4 micro-batches"
# ZeRO-2 with buckets during the backward (each reduced to the last rank, which sends the owners their sums)
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=2 --dist.bucket_mb=0.05 \
    --out="$tmp/zzb2" > /dev/null
cmp "$tmp/f64-m2" "$tmp/zzb2" "f64: dp 2 with ZeRO-2 and 0.05 MB buckets == one rank, 2 micro-batches"
"${mp[@]}" -np 4 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=2 --dist.bucket_mb=0.05 \
    --out="$tmp/zzb4" > /dev/null
cmp "$tmp/m4" "$tmp/zzb4" "f64: dp 4 with ZeRO-2 and 0.05 MB buckets == one rank, 4 micro-batches"
b1=$(grep -m1 -o '"dist/bytes_sent_mean":[0-9.]*' "$tmp/z4/metrics.jsonl" | cut -d: -f2)
b2=$(grep -m1 -o '"dist/bytes_sent_mean":[0-9.]*' "$tmp/zz4/metrics.jsonl" | cut -d: -f2)
awk -v a="$b1" -v b="$b2" 'BEGIN { exit !(b > 0 && b < 0.75 * a) }' \
    || { echo "FAIL dp 4 ZeRO-2 sends $b2 bytes a rank per step, ZeRO-1 $b1: expected under 3/4"; exit 1; }
echo "ok   dp 4 bytes per rank per step: ZeRO-2 $b2, ZeRO-1 $b1"
# the process group's count of every step's bytes == dist.step_bytes (the formula --dry-run plans with) within 1%
for r in "dp4 4" "z4 4" "zz4 4" "f64-dp2 2" "zz2 2" "zzb4 4"; do
    set -- $r
    "$tide" run tests/dist/dp_bytes.lua --dir="$tmp/$1" --ranks=$2
done
mkdir -p "$tmp/zzres"
cp -r "$tmp/zz2/ckpt" "$tmp/zzres/" && cp "$tmp/zz2/config.json" "$tmp/zzres/"
head -3 "$tmp/zz2/metrics.jsonl" > "$tmp/zzres/metrics.jsonl"
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --dist.zero=2 --out="$tmp/zzres" \
    --resume="$tmp/zzres/ckpt/step_00000003" > /dev/null
cmp "$tmp/zz2" "$tmp/zzres" "f64: dp 2 ZeRO-2 resumed at step 3 == uninterrupted"
# MoE (tests/dist/dp_moe.lua, f64): the balancers' routing batch spans the ranks — QB with the exact estimator
# (margins gathered in rank order) and the histogram one (counts summed), and the sign rule (loads summed): the
# selection biases, weights, moments and losses of dp 2 == one rank with 2 micro-batches, bitwise
for bal in "quantile --model.moe.estimator=exact" "quantile --model.moe.estimator=histogram" "sign" \
        "quantile --dist.bucket_mb=0.01"; do
    set -- $bal
    name=$(tr ' =' '__' <<< "$bal")
    "$tide" run tests/dist/dp_moe.lua --model.moe.balance=$1 ${2:-} --train.micro_batches=2 --out="$tmp/moe-m2-$name" \
        > /dev/null
    "${mp[@]}" -np 2 "$tide" run tests/dist/dp_moe.lua --model.moe.balance=$1 ${2:-} --out="$tmp/moe-dp2-$name" > /dev/null
    "$tide" run tests/dist/dp_compare.lua --a="$tmp/moe-m2-$name" --b="$tmp/moe-dp2-$name" --moe=true \
        --what="MoE $bal: dp 2 == one rank, 2 micro-batches (the MoE metrics too: the routing batch is both ranks')"
done
# a curriculum (tests/fixtures/curriculum_small.lua: 3 stages, hybrid MoE, 2 micro-batches a step, packed documents):
# under dp 2 each rank packs from its own data lane (documents j, j + 2, ... of each source: rank j reads only those);
# dp 2 == the same recipe on one rank hosting both lanes (--dist.lanes=2), for each QB estimator; and a dp 2 run
# resumed mid-curriculum (stage b, step 8) == uninterrupted
for est in exact histogram; do
    cur=(tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=$est --train.keep_ckpts=10)
    "$tide" run "${cur[@]}" --dist.lanes=2 --out="$tmp/cur-one-$est" > /dev/null
    "${mp[@]}" -np 2 "$tide" run "${cur[@]}" --out="$tmp/cur-dp2-$est" > /dev/null
    cmp "$tmp/cur-one-$est" "$tmp/cur-dp2-$est" "curriculum, QB $est: dp 2 == one rank"
done
"${mp[@]}" -np 2 "$tide" run tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=exact --dist.zero=1 \
    --out="$tmp/cur-z2" > /dev/null
cmp "$tmp/cur-one-exact" "$tmp/cur-z2" "curriculum, QB exact: dp 2 with ZeRO-1 == one rank"
"${mp[@]}" -np 2 "$tide" run tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=exact --dist.zero=2 \
    --out="$tmp/cur-zz2" > /dev/null
cmp "$tmp/cur-one-exact" "$tmp/cur-zz2" "curriculum, QB exact: dp 2 with ZeRO-2 == one rank"
mkdir -p "$tmp/cur-res"
cp -r "$tmp/cur-dp2-exact/ckpt" "$tmp/cur-res/" && cp "$tmp/cur-dp2-exact/config.json" "$tmp/cur-res/"
grep -E '^\{"step":[1-8],' "$tmp/cur-dp2-exact/metrics.jsonl" > "$tmp/cur-res/metrics.jsonl"
"${mp[@]}" -np 2 "$tide" run tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=exact \
    --train.keep_ckpts=10 --out="$tmp/cur-res" --resume="$tmp/cur-res/ckpt/step_00000008" > /dev/null
cmp "$tmp/cur-dp2-exact" "$tmp/cur-res" "curriculum: dp 2 resumed at step 8 (stage b) == uninterrupted"
# the lanes are disjoint: one lane alone (one rank, dist.lanes = 1) trains on other documents than the two lanes
"$tide" run tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=exact --out="$tmp/cur-1lane" > /dev/null
if "$tide" run tests/dist/dp_compare.lua --a="$tmp/cur-1lane" --b="$tmp/cur-one-exact" > /dev/null 2>&1; then
    echo "FAIL one data lane and two compare equal: the lanes change nothing"; exit 1; fi
echo "ok   one data lane and two lanes train on different documents"
# the dp 2 curriculum checkpoint (both lanes' states in state.json) resumed on one rank hosting both lanes ==
# uninterrupted; resumed with one lane: one line saying how many lanes it holds
mkdir -p "$tmp/cur-one-res"
cp -r "$tmp/cur-dp2-exact/ckpt" "$tmp/cur-one-res/" && cp "$tmp/cur-dp2-exact/config.json" "$tmp/cur-one-res/"
grep -E '^\{"step":[1-8],' "$tmp/cur-dp2-exact/metrics.jsonl" > "$tmp/cur-one-res/metrics.jsonl"
"$tide" run tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=exact --train.keep_ckpts=10 \
    --dist.lanes=2 --out="$tmp/cur-one-res" --resume="$tmp/cur-one-res/ckpt/step_00000008" > /dev/null
cmp "$tmp/cur-dp2-exact" "$tmp/cur-one-res" "curriculum: the dp 2 checkpoint resumed on one rank hosting both lanes == dp 2 uninterrupted"
if out=$("$tide" run tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=exact --out="$tmp/cur-bad" \
        --resume="$tmp/cur-dp2-exact/ckpt/step_00000008" 2>&1); then
    echo "FAIL a 2-lane checkpoint resumed with 1 lane must be an error"; exit 1; fi
grep -q "the checkpoint's data is in 2 lanes, this run reads 1 (set dist.lanes = 2 to resume it)" <<< "$out" \
    || { echo "FAIL the lane mismatch message: $out"; exit 1; }
echo "ok   a 2-lane checkpoint on one lane: $(grep -m1 'lanes' <<< "$out")"
# a non-finite loss on one rank skips the step on every rank (tests/dist/dp_nan.lua): dp 2 == one rank whose second
# micro-batch of step 3 is the non-finite one
"$tide" run tests/dist/dp_nan.lua "${small[@]}" --model.dtype=f64 --train.micro_batches=2 --out="$tmp/nan-m2" > /dev/null
"${mp[@]}" -np 2 "$tide" run tests/dist/dp_nan.lua "${small[@]}" --model.dtype=f64 --dist.bucket_mb=0.05 --out="$tmp/nan-dp2" > /dev/null
grep -q '"step":3,.*"skipped":true' "$tmp/nan-dp2/metrics.jsonl" || grep -q '"skipped":true.*"step":3,' "$tmp/nan-dp2/metrics.jsonl" \
    || { echo "FAIL step 3 of the dp 2 run is not recorded as skipped"; exit 1; }
cmp "$tmp/nan-m2" "$tmp/nan-dp2" "f64: a NaN loss on rank 1 at step 3 (7 buckets: rank 1 sends zeros): the step skipped on both ranks == one rank"
# a dp 2 checkpoint resumed on one rank with 2 micro-batches (the state is replicated, the data cursor global)
mkdir -p "$tmp/one"
cp -r "$tmp/f64-dp2/ckpt" "$tmp/one/" && cp "$tmp/f64-dp2/config.json" "$tmp/one/"
head -3 "$tmp/f64-dp2/metrics.jsonl" > "$tmp/one/metrics.jsonl"
"$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --train.micro_batches=2 --out="$tmp/one" \
    --resume="$tmp/one/ckpt/step_00000003" > /dev/null
cmp "$tmp/f64-dp2" "$tmp/one" "f64: dp 2 checkpoint resumed on one rank (2 micro-batches) == dp 2 uninterrupted"
# the sharded layout: each of the 2 ranks wrote its shard of the weights and of the moments, with the two index files,
# and no single file; the index names every tensor, and each shard holds between a third and two thirds of the bytes
s3="$tmp/f64-dp2/ckpt/step_00000003"
for f in model-00001-of-00002 model-00002-of-00002 optim-00001-of-00002 optim-00002-of-00002; do
    [ -s "$s3/$f.safetensors" ] || { echo "FAIL $s3/$f.safetensors is missing"; exit 1; }; done
[ -s "$s3/model.safetensors.index.json" ] && [ -s "$s3/optim.safetensors.index.json" ] && [ ! -e "$s3/model.safetensors" ] \
    || { echo "FAIL $s3 is not the sharded layout: $(ls "$s3")"; exit 1; }
for kind in model optim; do
    a=$(stat -c %s "$s3/$kind-00001-of-00002.safetensors"); b=$(stat -c %s "$s3/$kind-00002-of-00002.safetensors")
    [ $((3 * a)) -ge $((a + b)) ] && [ $((3 * a)) -le $((2 * (a + b))) ] \
        || { echo "FAIL $kind shards of $a and $b bytes are not balanced"; exit 1; }
done
info=$("$tide" ckpt info "$s3")
grep -q "saved by a run of 2 ranks" <<< "$info" && grep -q "model.safetensors  21 tensors, .* 2 shards" <<< "$info" \
    || { echo "FAIL tide ckpt info: $info"; exit 1; }
echo "ok   a dp 2 checkpoint is 2 model + 2 optim shards with their indexes ($(stat -c %s "$s3/model-00001-of-00002.safetensors") + $(stat -c %s "$s3/model-00002-of-00002.safetensors") model bytes)"
# tide ckpt consolidate: the shards as single files, the same tensors bitwise; resumed on one rank with 2 micro-batches
# (dp 2 -> dp 1) == the dp 2 run uninterrupted
"$tide" ckpt consolidate "$s3" --out="$tmp/cons/ckpt/step_00000003" > /dev/null
[ -s "$tmp/cons/ckpt/step_00000003/model.safetensors" ] && [ ! -e "$tmp/cons/ckpt/step_00000003/model.safetensors.index.json" ] \
    || { echo "FAIL consolidate wrote $(ls "$tmp/cons/ckpt/step_00000003")"; exit 1; }
"$tide" run tests/dist/dp_compare.lua --a="$s3" --b="$tmp/cons/ckpt/step_00000003" --losses=false \
    --what="tide ckpt consolidate: one file == the 2 shards"
cp "$tmp/f64-dp2/config.json" "$tmp/cons/" && head -3 "$tmp/f64-dp2/metrics.jsonl" > "$tmp/cons/metrics.jsonl"
"$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --train.micro_batches=2 --out="$tmp/cons" \
    --resume="$tmp/cons/ckpt/step_00000003" > /dev/null
cmp "$tmp/f64-dp2" "$tmp/cons" "f64: the consolidated dp 2 checkpoint resumed on one rank == dp 2 uninterrupted"
# rank 1 SIGKILLed inside a save (its model shard written, the step not yet complete): the job ends, the step
# directory never appears (only its .tmp), latest still names step 3, and the next start resumes from it to the
# uninterrupted run
mkdir -p "$tmp/ckill"
cp -r "$tmp/f64-dp2/ckpt" "$tmp/ckill/" && cp "$tmp/f64-dp2/config.json" "$tmp/ckill/"
rm -rf "$tmp/ckill/ckpt/step_00000006" && echo step_00000003 > "$tmp/ckill/ckpt/latest"
head -3 "$tmp/f64-dp2/metrics.jsonl" > "$tmp/ckill/metrics.jsonl"
if out=$("${mp[@]}" -np 2 -x TIDE_TEST_CKPT_KILL=tmp -x TIDE_TEST_CKPT_KILL_RANK=1 "$tide" run recipes/dense.lua \
        "${small[@]}" --model.dtype=f64 --out="$tmp/ckill" --resume 2>&1); then
    echo "FAIL a rank killed inside a save must end the job"; exit 1; fi
[ ! -e "$tmp/ckill/ckpt/step_00000006" ] && [ -d "$tmp/ckill/ckpt/step_00000006.tmp" ] \
    && [ "$(cat "$tmp/ckill/ckpt/latest")" = step_00000003 ] \
    || { echo "FAIL after the kill: $(ls "$tmp/ckill/ckpt"), latest $(cat "$tmp/ckill/ckpt/latest")"; exit 1; }
echo "ok   rank 1 killed inside the step-6 save: only step_00000006.tmp was left, latest names step 3"
"${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --out="$tmp/ckill" --resume > /dev/null
cmp "$tmp/f64-dp2" "$tmp/ckill" "f64: dp 2 resumed after a rank died inside a save == uninterrupted"
# the dist table's keys under mpirun: a cp that does not divide the ranks is refused, and gpus must be the ranks (ep: tests/dist/ep_check.sh)
for bad in "--dist.cp=3|dist.cp = 3 does not divide the job's 2 ranks" "--dist.gpus=4|dist.gpus = 4 but the job has 2 ranks" \
        "--dist.zero=3|dist.zero = 3 (FSDP: the weights sharded too) is planned by --dry-run but not run yet" \
        "--dist.lanes=3|dist.lanes = 3 must be a multiple of the 2 ranks that read data"; do
    if out=$("${mp[@]}" -np 2 "$tide" run tests/fixtures/curriculum_small.lua "${bad%%|*}" --out="$tmp/plan" 2>&1); then
        echo "FAIL ${bad%%|*} under dp 2 must be an error"; exit 1; fi
    grep -q "${bad#*|}" <<< "$out" || { echo "FAIL ${bad%%|*}: $out"; exit 1; }
    echo "ok   ${bad%%|*} under mpirun -np 2: $(grep -m1 "${bad#*|}" <<< "$out")"
done
# errors: dist.dp against the ranks; a failing rank ends the job, naming itself
if out=$("$tide" run recipes/dense.lua "${small[@]}" --dist.dp=2 --out="$tmp/bad" 2>&1); then
    echo "FAIL dist.dp = 2 on one rank must be an error"; exit 1; fi
grep -q "dist.dp = 2 but the job has 1 rank" <<< "$out" || { echo "FAIL dist.dp message: $out"; exit 1; }
echo "ok   dist.dp = 2 on one rank: $(tail -1 <<< "$out")"
# a rank that raises (or is SIGKILLed) after the step-3 checkpoint ends the job, named; the checkpoint loads and the run
# resumed from it under dp 2 is the uninterrupted one
for how in FAIL KILL; do
    start=$(date +%s)
    env=(-x TIDE_TEST_${how}_RANK=1)
    if out=$("${mp[@]}" -np 2 "${env[@]}" "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 \
            --out="$tmp/fail$how" 2>&1); then
        echo "FAIL a rank that fails ($how) must end the job with an error"; exit 1; fi
    took=$(( $(date +%s) - start ))
    [ $took -le 60 ] || { echo "FAIL the job took $took s to stop after rank 1 failed ($how)"; exit 1; }
    if [ $how = FAIL ]; then
        grep -q "rank 1" <<< "$out" || { echo "FAIL the error does not name the rank: $out"; exit 1; }
        echo "ok   a rank that raises ends the job in $took s: $(grep -m1 'rank 1' <<< "$out")"
    else
        echo "ok   a rank that is SIGKILLed ends the job in $took s: $(grep -m1 -iE 'signal|killed|exited' <<< "$out" || true)"
    fi
    "${mp[@]}" -np 2 "$tide" run recipes/dense.lua "${small[@]}" --model.dtype=f64 --out="$tmp/fail$how" --resume > /dev/null
    cmp "$tmp/f64-dp2" "$tmp/fail$how" "f64: dp 2 resumed from the checkpoint left by the failed job ($how) == uninterrupted"
done
echo "dp_check: all passed"
