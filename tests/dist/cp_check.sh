#!/usr/bin/env bash
# cp_check.sh — context parallelism over MPI (spec/long_context.md §5, DESIGN.md §9) against one rank:
# - KDA, MLA and the small hybrid (tests/dist/cp_layer.lua): cp 2 and cp 4 == the unsplit rows (this rank's slices of
#   the output and input gradient, the parameter gradients summed; f64 1e-10, f32 1e-5 rel), documents starting inside
#   segments, exactly at segment edges and inside the next segment's conv history;
# - the tiny hybrid MoE model (tests/dist/dp_moe.lua: KDA + MLA, 8 experts top-2 + shared, QB) for 6 steps: cp 2,
#   cp 4, dp 2 x cp 2 and ep 2 x cp 2 == one rank with as many micro-batches as there are data ranks (weights, AdamW
#   moments, losses to 1e-12 relative in f64, the MoE load metrics exactly); in f32 the losses to 1e-6 and the weights
#   to 5e-5 (AdamW's first steps, ≈ lr·sign(g), turn rounding into larger differences where a gradient is near zero);
# - dp 2 x cp 2 and ep 2 x cp 2 with gradient buckets summed during the backward == without them, bitwise;
# - the tiny VLM recipe (images spliced into the packed rows) under cp 2 == one rank;
# - a cp 2 run resumed from its step-3 checkpoint == the uninterrupted one, bitwise; and resumed on one rank == it;
# - the 3-stage curriculum of the tests (packed documents, stage switches; its held-out loss on the slices) under cp 2
#   == one rank, f64, 1e-8: the losses agree to 1e-16 until the stage whose segments hold two KDA chunks, where the
#   fold composes the chunk path's states in another order (1e-14 in the loss), which AdamW grows to ~4e-10 in the
#   weights over 6 steps;
# - layouts that do not fit: one clear line each.
# Usage: tests/dist/cp_check.sh [BUILD_DIR]
who=cp_check
source "$(dirname "$0")/setup.sh"
cmp() { "$tide" run tests/dist/dp_compare.lua --a="$1" --b="$2" --rel="$3" --moe=true --what="$4"; }

# the layers
for n in 2 4; do "${mp[@]}" -np $n "$tide" run tests/dist/cp_layer.lua; done

# the model
"$tide" run tests/dist/dp_moe.lua --out="$tmp/one" > /dev/null
out=$("${mp[@]}" -np 2 "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --train.quiet=false --out="$tmp/cp2" 2>&1)
cmp "$tmp/one" "$tmp/cp2" 1e-12 "f64: cp 2 == one rank"
grep -q "ranks: 2 = dp 1 x cp 2 (rank = d·2 + c); the context-parallel groups {0,1} hold the zig-zag slices of the same rows" \
    <<< "$out" || { echo "FAIL cp 2 printed no rank map:"; echo "$out" | head -20; exit 1; }
grep -q "memory per rank measured: engine peak .* (ranks 0..1)" <<< "$out" \
    || { echo "FAIL cp 2 printed no per-rank peak:"; echo "$out" | tail -5; exit 1; }
echo "ok   cp 2 prints its rank map and each rank's peak"
"${mp[@]}" -np 4 "$tide" run tests/dist/dp_moe.lua --dist.cp=4 --out="$tmp/cp4" > /dev/null
cmp "$tmp/one" "$tmp/cp4" 1e-12 "f64: cp 4 == one rank"
# a recipe's own loss (tests/dist/cp_loss.lua: Σ cross-entropy over the step's targets, from the loss's ctx) sees
# each rank's slices, its forward the slices' context: cp 2 == the one-rank default objective
"${mp[@]}" -np 2 "$tide" run tests/dist/cp_loss.lua --dist.cp=2 --out="$tmp/own-cp2" > /dev/null
cmp "$tmp/one" "$tmp/own-cp2" 1e-12 "f64: a recipe's own loss at cp 2 == one rank's default objective"
"$tide" run tests/dist/dp_moe.lua --train.micro_batches=2 --out="$tmp/m2" > /dev/null
"${mp[@]}" -np 4 "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --dist.dp=2 --out="$tmp/dp2cp2" > /dev/null
cmp "$tmp/m2" "$tmp/dp2cp2" 1e-12 "f64: dp 2 x cp 2 == one rank, 2 micro-batches"
"${mp[@]}" -np 4 "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --dist.ep=2 --out="$tmp/ep2cp2" > /dev/null
cmp "$tmp/m2" "$tmp/ep2cp2" 1e-12 "f64: ep 2 x cp 2 == one rank, 2 micro-batches"
# gradient buckets summed on the helper thread while the backward exchanges with the cp and ep groups (MPI_THREAD_MULTIPLE,
# the sums on the reducers' own communicator): bitwise the runs without buckets; the sums ran during the backward
"${mp[@]}" -np 4 "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --dist.dp=2 --dist.bucket_mb=0.05 --out="$tmp/dp2cp2b" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/dp2cp2" --b="$tmp/dp2cp2b" --moe=true \
    --what="f64: dp 2 x cp 2 with 0.05 MB buckets during the backward == without (bitwise)"
"${mp[@]}" -np 4 "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --dist.ep=2 --dist.bucket_mb=0.05 --out="$tmp/ep2cp2b" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/ep2cp2" --b="$tmp/ep2cp2b" --moe=true \
    --what="f64: ep 2 x cp 2 with 0.05 MB buckets during the backward == without (bitwise)"
"${mp[@]}" -np 4 "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --dist.ep=2 --dist.zero=2 --dist.bucket_mb=0.05 \
    --out="$tmp/ep2cp2z2" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/ep2cp2" --b="$tmp/ep2cp2z2" --moe=true \
    --what="f64: ep 2 x cp 2 with ZeRO-2 and 0.05 MB buckets == without (bitwise)"
for r in dp2cp2b ep2cp2b; do
    grep -q '"dist/buckets":[1-9]' "$tmp/$r/metrics.jsonl" && grep -qE '"dist/overlap":(0\.[0-9]*[1-9]|[1-9])' "$tmp/$r/metrics.jsonl" \
        || { echo "FAIL $r: no bucket summed during the backward: $(head -1 "$tmp/$r/metrics.jsonl")"; exit 1; }
done
echo "ok   buckets under cp and ep: summed while the backward ran (overlap share per step, ep 2 x cp 2: $(grep -o '"dist/overlap":[0-9.e-]*' "$tmp/ep2cp2b/metrics.jsonl" | cut -d: -f2 | tr '\n' ' '))"
f32=(--model.dtype=f32 --train.steps=5)
"$tide" run tests/dist/dp_moe.lua "${f32[@]}" --out="$tmp/f32-one" > /dev/null
"${mp[@]}" -np 2 "$tide" run tests/dist/dp_moe.lua "${f32[@]}" --dist.cp=2 --out="$tmp/f32-cp2" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/f32-one" --b="$tmp/f32-cp2" --rel=1e-6 --wrel=5e-5 --moe=true \
    --what="f32: cp 2 == one rank (losses 1e-6, weights 5e-5)"

# images under cp: every rank of the group encodes the batch's images and splices the tokens its slices' placeholders
# take (recipes/vlm_tiny.lua: images and text in one packed stream, through its text-only and frozen stages)
vlm=(recipes/vlm_tiny.lua --scale=smoke --model.dtype=f64)
"$tide" run "${vlm[@]}" --out="$tmp/vlm-one" > /dev/null
"${mp[@]}" -np 2 "$tide" run "${vlm[@]}" --dist.cp=2 --out="$tmp/vlm-cp2" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/vlm-one" --b="$tmp/vlm-cp2" --rel=1e-12 \
    --what="vlm f64: images under cp 2 == one rank"

# resume: under cp 2 (bitwise) and on one rank
for how in cp2 one; do
    mkdir -p "$tmp/res-$how"
    cp -r "$tmp/cp2/ckpt" "$tmp/res-$how/" && cp "$tmp/cp2/config.json" "$tmp/res-$how/"
    head -3 "$tmp/cp2/metrics.jsonl" > "$tmp/res-$how/metrics.jsonl"
done
"${mp[@]}" -np 2 "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --out="$tmp/res-cp2" \
    --resume="$tmp/res-cp2/ckpt/step_00000003" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/cp2" --b="$tmp/res-cp2" --what="f64: cp 2 resumed at step 3 == uninterrupted (bitwise)"
"$tide" run tests/dist/dp_moe.lua --out="$tmp/res-one" --resume="$tmp/res-one/ckpt/step_00000003" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/cp2" --b="$tmp/res-one" --rel=1e-12 \
    --what="f64: cp 2 checkpoint resumed on one rank == cp 2 uninterrupted"

# a curriculum with packed documents and stage switches
cur=(tests/fixtures/curriculum_small.lua --threads=1 --model.moe.estimator=exact --model.dtype=f64)
"$tide" run "${cur[@]}" --out="$tmp/cur-one" > /dev/null
"${mp[@]}" -np 2 "$tide" run "${cur[@]}" --dist.cp=2 --out="$tmp/cur-cp2" > /dev/null
"$tide" run tests/dist/dp_compare.lua --a="$tmp/cur-one" --b="$tmp/cur-cp2" --rel=1e-8 \
    --what="curriculum f64: cp 2 == one rank"

# layouts that do not fit: one line each
bad "dist.cp = 3 does not divide the job's 2 ranks" "${mp[@]}" -np 2 "$tide" run tests/dist/dp_moe.lua --dist.cp=3 --out="$tmp/b1"
bad "does not cut into 2·cp = 6 equal segments" "${mp[@]}" -np 3 "$tide" run tests/dist/dp_moe.lua --dist.cp=3 --out="$tmp/b2"
bad "dist.cp = 2 does not divide the job's 1 rank" "$tide" run tests/dist/dp_moe.lua --dist.cp=2 --out="$tmp/b4"
bad "shorter than the short convolution's history" "${mp[@]}" -np 4 "$tide" run tests/dist/dp_moe.lua --dist.cp=4 \
    --data.seq_len=16 --out="$tmp/b5"
echo "ok   layouts that do not fit: one clear line each"
