#!/usr/bin/env bash
# gpu_check.sh — one-shot validation of the CUDA backend on a machine with an NVIDIA GPU (one that may never have
# run CUDA before): checks the driver, the device, its architecture and the toolkit, builds with CUDA, runs the
# CPU-vs-GPU parity test of every op and the CUDA emulator cases, and times the GPU benchmarks (the dense step at
# GPT-2-small shape, KDA chunk forward + backward at T = 4K/16K/64K, and at K3 head shapes with its column split off,
# its chunk pre-pass off and both on, MLA attention, the MoE layer, the quickstart model's training step). Every
# stage runs under its own timeout and the run goes on after a failed stage; logs, benchmark JSON and a summary
# (summary.md, summary.json: each stage's status, time and key numbers) go to the output directory. Exit 0 when
# every stage passed, 1 when one failed, 2 on a bad argument.
#
#   scripts/gpu_check.sh              everything, within about 8 minutes on an H200 (a build of ~2.5 min included)
#   scripts/gpu_check.sh --quick      smaller sizes, fewer benchmarks: under 3 minutes after the build
#   scripts/gpu_check.sh --dry-run    print every command and check that everything it needs is here (no GPU needed)
#   options: --build-dir=DIR (build-gpu) --out=DIR (bench/results/gpu) --jobs=N (nproc)
#            --budget=SECONDS: for the stages after the build (330, quick 150); a stage that would start past it
#            is skipped (and counts as failed), one that runs is cut at the budget's end
#            --no-build: use the build directory as it is
set -u

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
mode=full dry=0 build_dir=build-gpu out=bench/results/gpu budget= nobuild=0 jobs=$(nproc 2>/dev/null || echo 4)
for a in "$@"; do
    case $a in
    --quick) mode=quick ;;
    --dry-run) dry=1 ;;
    --no-build) nobuild=1 ;;
    --build-dir=*) build_dir=${a#*=} ;;
    --out=*) out=${a#*=} ;;
    --budget=*) budget=${a#*=} ;;
    --jobs=*) jobs=${a#*=} ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$a' (see --help)" >&2; exit 2 ;;
    esac
done
case $budget in '') budget=$([ $mode = quick ] && echo 150 || echo 330) ;; *[!0-9]*) echo "gpu_check: --budget must be seconds, got '$budget'" >&2; exit 2 ;; esac
tide="$build_dir/tide"
cuda_home=${CUDA_HOME:-}
nvcc=${NVCC:-$(command -v nvcc 2>/dev/null || true)}
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
[ -z "$cuda_home" ] && [ -n "$nvcc" ] && cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)

# ---- the plan: stage name, timeout (s), command ------------------------------------------------------------------
if [ $mode = quick ]; then
    dense_opts="--batch=4 --seq=512 --warmup=1 --steps=3"
    kda_opts="--sizes=4096,16384 --reps=1 --model_tokens=0"
    mla_opts="--sizes=4096 --baseline_max=4096 --reps=1"
    qs_opts="--stages=s128,s1024 --warmup=1 --steps=2"
    emu_groups="gate conv kdasmall mlasmall attnsmall"
else
    dense_opts="--batch=8 --seq=1024 --warmup=2 --steps=5"
    kda_opts="--sizes=4096,16384,65536 --reps=2 --model_tokens=0"
    mla_opts="--sizes=4096,16384,65536 --baseline_max=16384 --reps=2"
    qs_opts="--warmup=1 --steps=3"
    emu_groups=""
fi
bench() { echo "$tide run bench/$1.lua --device=cuda --results=$out $2"; }
configure_cmd="cmake -S . -B $build_dir -DCMAKE_BUILD_TYPE=Release -DTIDE_CUDA=ON"
build_cmd="cmake --build $build_dir -j$jobs"
emu_env="BUILD=$root/$build_dir OUT=$root/$build_dir/emu CUDA_HOME=$cuda_home"
# the recipe itself (data pipeline, curriculum) runs on the GPU only where its model table takes a device
recipe_cmd="$tide run recipes/quickstart.lua --model.device=cuda --stages.1.steps=2 --stages.1.lr.warmup=1 \
--stages.1.eval.every=0 --stages.2.steps=1 --stages.3.steps=1 --stages.4.steps=1 --evals.1.examples=8 \
--expect.final_loss_below=100 --expect.eval_accuracy_above=-1 --train.out=$build_dir/runs/quickstart --train.ckpt_every=0"
dense_cmd="$tide run recipes/dense.lua --model.device=cuda --train.steps=20 --train.eval_every=10 --train.eval_batches=2 \
--train.ckpt_every=0 --train.log_every=5 --train.out=$build_dir/runs/dense --schedule.warmup=5 --schedule.decay_start=15 \
--schedule.decay_end=20 --sample.max_new_tokens=32 --expect.final_loss_below=100"
stages=(
    "parity|180|$build_dir/gpu-test-parity"
    "nccl|60|$build_dir/gpu-test-nccl"
    "step_dense|150|$(bench step_dense "--only=gpt2-small --baseline=false $dense_opts")"
    "kda|150|$(bench kda "$kda_opts")"
    "mla|120|$(bench mla "$mla_opts")"
)
# K3 head shapes (96 heads of one sequence: fewer blocks than SMs): KDA with its column split off, with its
# chunk pre-pass off, then as the code chooses (both on)
k3_kda="--device=cuda --heads=96 --head_dim=128 --sizes=16384 --reps=1 --model_tokens=0"
[ $mode = full ] && stages+=(
    "kda_k3_nosplit|60|env TIDE_KDA_VSPLIT=1 $tide run bench/kda.lua $k3_kda --results=$out/kda_k3_nosplit"
    "kda_k3_noprepass|60|env TIDE_KDA_PREPASS=0 $tide run bench/kda.lua $k3_kda --results=$out/kda_k3_noprepass"
    "kda_k3_split|60|$tide run bench/kda.lua $k3_kda --results=$out/kda_k3_split")
[ $mode = full ] && stages+=("moe|120|$(bench moe "--sizes=8192,32768 --reps=3")")
stages+=("quickstart_step|150|$(bench quickstart_step "$qs_opts")")
[ $mode = full ] && stages+=("quickstart_recipe|180|$recipe_cmd" "dense_recipe|120|$dense_cmd")
emu_cmds=(
    "emu_kda_mla_attention|env $emu_env sh tests/gpu/emu/run.sh $emu_groups"
    "emu_attnres|env $emu_env sh tests/gpu/emu/run_one.sh attnres"
    "emu_moe|env $emu_env sh tests/gpu/emu/run_one.sh moe"
    "emu_vision|env $emu_env sh tests/gpu/emu/run_one.sh vision"
    "emu_optim|env $emu_env sh tests/gpu/emu/run_one.sh optim"
    "emu_loss|env $emu_env sh tests/gpu/emu/run_one.sh loss"
    "emu_index|env $emu_env sh tests/gpu/emu/run_one.sh index"
)

# the CUDA architectures the build targets (CMakeLists.txt: CUDA_ARCHITECTURES "80;90")
archs=$(sed -n 's/.*CUDA_ARCHITECTURES *"\([0-9;]*\)".*/\1/p' CMakeLists.txt | head -1 | tr ';' ' ')

# ---- dry run: print the plan, check that everything it needs is here ---------------------------------------------
if [ $dry = 1 ]; then
    missing=()
    need_file() { [ -e "$1" ] || missing+=("$1 ($2)"); }
    need_cmd() { command -v "$1" >/dev/null 2>&1 || missing+=("$1 on PATH ($2)"); }
    # a --key=value of a benchmark must be a field of the table the benchmark returns
    need_opts() {
        local file=$1 k; shift
        for k in "$@"; do
            k=${k%%=*}; k=${k#--}
            grep -Eq "^  ([a-z_]+ = [^,]*, )*$k = " "$file" || missing+=("option --$k of $file (not a field of its config table)")
        done
    }
    echo "gpu_check --dry-run ($mode mode, budget ${budget}s, build dir $build_dir, results in $out)"
    echo "checks: nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total; libcuda.so.1 on the loader path;"
    echo "        compute capability covered by the build's targets (sm_${archs// /, sm_}); $nvcc --version (its CUDA release"
    echo "        no newer in major than the driver's); $nvcc --list-gpu-arch covers those targets"
    [ $nobuild = 1 ] || { echo "build:  $configure_cmd"; echo "        $build_cmd"; }
    for s in "${emu_cmds[@]}"; do echo "emu:    (background) ${s#*|}"; done
    for s in "${stages[@]}"; do name=${s%%|*}; r=${s#*|}; echo "$name: timeout ${r%%|*} ${r#*|}"; done
    echo "then:   $out/summary.md and $out/summary.json"
    need_cmd cmake "the build"; need_cmd timeout "the stage timeouts"; need_cmd g++ "the emulator"
    need_cmd python3 "the emulator's source transform and the summary"; need_cmd nproc "the build's job count"
    [ -n "$nvcc" ] && [ -x "$nvcc" ] || missing+=("nvcc (PATH, NVCC or /usr/local/cuda/bin/nvcc: the CUDA toolkit)")
    [ -n "$cuda_home" ] && [ -e "$cuda_home/include/cuda_runtime.h" ] || missing+=("CUDA headers (CUDA_HOME/include/cuda_runtime.h)")
    [ -n "$archs" ] || missing+=("CUDA_ARCHITECTURES in CMakeLists.txt")
    if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then
        for a in $archs; do "$nvcc" --list-gpu-arch 2>/dev/null | grep -qx "compute_$a" || missing+=("sm_$a support in $nvcc"); done
    fi
    for f in CMakeLists.txt tests/gpu/test_parity.c engine/host/main.c tests/gpu/emu/run.sh tests/gpu/emu/run_one.sh \
        tests/gpu/emu/transform.py tests/gpu/emu/harness.cpp tests/gpu/emu/attnres.cpp tests/gpu/emu/moe.cpp \
        tests/gpu/emu/vision.cpp tests/gpu/emu/optim.cpp tests/gpu/emu/loss.cpp tests/gpu/emu/host_data.h recipes/quickstart.lua bench/step_dense.lua bench/kda.lua bench/mla.lua bench/moe.lua \
        bench/quickstart_step.lua kernels/cuda/attention.cu; do need_file "$f" "used by a stage"; done
    grep -q 'tests/gpu/test_\*\.c' CMakeLists.txt || missing+=("the tests/gpu/test_*.c targets in CMakeLists.txt (gpu-test-parity)")
    grep -q 'OUTPUT_NAME tide' CMakeLists.txt || missing+=("the tide executable target in CMakeLists.txt")
    if [ -f "$build_dir/CMakeCache.txt" ]; then
        targets=$(cmake --build "$build_dir" --target help 2>/dev/null)
        for t in gpu-test-parity tide_exe tide_cuda; do
            grep -q "$t" <<<"$targets" || missing+=("target $t in $build_dir (configured without CUDA?)")
        done
        echo "build dir $build_dir is configured: targets gpu-test-parity, tide_exe, tide_cuda checked"
    fi
    [ $nobuild = 1 ] && { [ -x "$tide" ] || missing+=("$tide (--no-build needs a built tree)"); [ -x "$build_dir/gpu-test-parity" ] || missing+=("$build_dir/gpu-test-parity (--no-build)"); }
    need_opts bench/step_dense.lua --only --baseline --batch --seq --warmup --steps --device --results
    need_opts bench/kda.lua --sizes --reps --model_tokens --device --results --heads --head_dim
    need_opts bench/mla.lua --sizes --baseline_max --reps --device --results
    need_opts bench/moe.lua --sizes --reps --device --results
    need_opts bench/quickstart_step.lua --stages --warmup --steps --device --results
    if [ ${#missing[@]} -gt 0 ]; then
        for m in "${missing[@]}"; do echo "gpu_check --dry-run: missing: $m" >&2; done
        exit 1
    fi
    echo "gpu_check --dry-run: everything the run needs is here"
    exit 0
fi

# ---- the run -----------------------------------------------------------------------------------------------------
mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 1; }
# only what this script writes: a README or other files there stay
rm -f "$out"/*.log "$out"/summary.json "$out"/summary.md "$out/.stages.tsv"
for b in step_dense kda mla moe quickstart_step; do rm -f "$out/$b.json" "$out/$b.md"; done
t_start=$(date +%s)
deadline=$((t_start + 100000))   # the build runs under its own timeouts; the budget starts after it
failed=0
now() { date +%s.%N; }
# record NAME STATUS SECONDS RC LOG NOTE
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$(printf '%s' "$6" | tr '\t\n' '  ')" >>"$out/.stages.tsv"; }
# stage NAME TIMEOUT COMMAND...: runs it under the timeout the budget leaves; pass when it exits 0
stage() {
    local name=$1 tmo=$2; shift 2
    local left=$((deadline - $(date +%s))) log="$out/$name.log"
    if [ $left -lt 15 ]; then
        echo "== $name: skipped (the ${budget}s budget is spent)"; record "$name" skip 0 - "" "time budget spent"
        failed=1; return 1
    fi
    [ $tmo -gt $left ] && tmo=$left
    echo "== $name (timeout ${tmo}s): $*"
    local t0 t1 rc
    t0=$(now)
    timeout -k 10 "$tmo" "$@" >"$log" 2>&1
    rc=$?
    t1=$(now)
    local secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    local status=pass note=""
    if [ $rc = 124 ] || [ $rc = 137 ]; then status=fail note="timed out after ${tmo}s"
    elif [ $rc = 77 ]; then status=fail note="skipped itself: no usable CUDA device ($(grep -m1 -o 'no CUDA device.*' "$log"))"
    elif [ $rc != 0 ]; then status=fail note="exit $rc: $( { grep -m1 '^tide: ' "$log" || grep -iE 'error|fail' "$log" | tail -1; } | cut -c1-200)"
    fi
    echo "   $status in ${secs}s${note:+ ($note)}"
    [ $status = fail ] && { failed=1; tail -5 "$log" | sed 's/^/   | /'; }
    record "$name" $status "$secs" $rc "$log" "$note"
    [ $status = pass ]
}
fail_pre() { echo "gpu_check: $1" >&2; record preflight fail 0 1 "" "$1"; failed=1; }

# preflight: driver, device, architecture, toolkit (one clear line for whatever is missing)
pre_ok=1
{
    if ! command -v nvidia-smi >/dev/null 2>&1; then fail_pre "nvidia-smi not found: no NVIDIA driver is installed"; pre_ok=0
    elif ! q=$(nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader 2>&1) || [ -z "$q" ]; then
        fail_pre "nvidia-smi found no usable GPU: $(echo "$q" | head -1)"; pre_ok=0
    else
        gpu=$(echo "$q" | head -1)
        echo "device: $gpu"
        cc=$(echo "$gpu" | cut -d, -f2 | tr -d ' ')
        drv_cuda=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -1 | awk '{print $3}')
        libcuda=$( { ldconfig -p 2>/dev/null | grep -o '=> .*libcuda\.so\.1$' | cut -c4-; \
            for d in ${LD_LIBRARY_PATH//:/ } /usr/lib64 /usr/lib/x86_64-linux-gnu /usr/local/nvidia/lib64; do
                ls "$d/libcuda.so.1" 2>/dev/null; done; } | head -1)
        [ -n "$libcuda" ] && echo "driver library: $libcuda"
        if [ -z "$libcuda" ]; then
            fail_pre "libcuda.so.1 (the driver's CUDA library) is not on the loader path"; pre_ok=0
        fi
        ccn=${cc/./}
        covered=""
        for a in $archs; do
            if [ "$a" = "$ccn" ] || { [ "${a:0:1}" = "${ccn:0:1}" ] && [ "$ccn" -ge "$a" ]; }; then covered=sm_$a; fi
        done
        maxa=$(echo $archs | tr ' ' '\n' | sort -n | tail -1); mina=$(echo $archs | tr ' ' '\n' | sort -n | head -1)
        if [ -z "$covered" ] && [ "$ccn" -gt "$maxa" ]; then
            echo "device: compute capability $cc is newer than the build's targets ($archs): kernels run from compute_$maxa PTX (JIT at first launch)"
        elif [ -z "$covered" ]; then
            fail_pre "compute capability $cc is not covered by the build's targets (sm_${archs// /, sm_}; the oldest is sm_$mina)"; pre_ok=0
        else
            echo "device: compute capability $cc runs the build's $covered code"
        fi
        if [ -z "$nvcc" ] || [ ! -x "$nvcc" ]; then fail_pre "nvcc not found (PATH, NVCC, /usr/local/cuda/bin/nvcc): the CUDA toolkit is needed to build"; pre_ok=0
        else
            tk=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
            echo "toolkit: $nvcc, CUDA $tk; driver ${drv_cuda:-?} (supports CUDA ${drv_cuda:-?})"
            if [ -n "$drv_cuda" ] && [ -n "$tk" ] && [ "${tk%%.*}" -gt "${drv_cuda%%.*}" ]; then
                fail_pre "the driver supports CUDA $drv_cuda but the toolkit is CUDA $tk: the runtime would refuse the device (install a driver for CUDA ${tk%%.*}, or build with an older toolkit via NVCC)"; pre_ok=0
            fi
            for a in $archs; do
                "$nvcc" --list-gpu-arch 2>/dev/null | grep -qx "compute_$a" || { fail_pre "$nvcc cannot build sm_$a"; pre_ok=0; }
            done
        fi
    fi
    command -v cmake >/dev/null 2>&1 || { fail_pre "cmake not found"; pre_ok=0; }
} 2>&1 | tee "$out/preflight.log"
grep -q '^gpu_check: ' "$out/preflight.log" && pre_ok=0
[ $pre_ok = 1 ] && record preflight pass 0 0 "$out/preflight.log" "$(grep -m1 '^device: ' "$out/preflight.log" | cut -c9-)"

built=0
if [ $pre_ok = 1 ]; then
    if [ $nobuild = 1 ]; then
        [ -x "$tide" ] && [ -x "$build_dir/gpu-test-parity" ] && built=1 || fail_pre "--no-build: $build_dir has no tide or gpu-test-parity"
    else
        stage configure 120 $configure_cmd && stage build 420 $build_cmd && built=1
    fi
fi
deadline=$(( $(date +%s) + budget ))

if [ $built = 1 ]; then
    # the emulator runs on the CPU: beside the GPU stages, at low priority
    emu_pids=()
    for e in "${emu_cmds[@]}"; do
        (stage "${e%%|*}" 400 nice -n 10 ${e#*|}) &
        emu_pids+=($!)
    done
    for s in "${stages[@]}"; do
        name=${s%%|*}; r=${s#*|}; tmo=${r%%|*}; cmd=${r#*|}
        # a recipe whose model table has no device field cannot be moved to the GPU from the command line
        rf=""; case $name in quickstart_recipe) rf=recipes/quickstart.lua ;; dense_recipe) rf=recipes/dense.lua ;; esac
        if [ -n "$rf" ] && ! awk '/^  model = \{/,/^  \},?$/' "$rf" | grep -q 'device = '; then
            echo "== $name: skipped ($rf has no model.device field to override)"
            record "$name" skip 0 - "" "$rf has no model.device field to override"
            continue
        fi
        stage "$name" "$tmo" $cmd
    done
    for p in "${emu_pids[@]}"; do wait "$p"; done
else
    echo "gpu_check: no build: the GPU stages did not run" >&2
    record gpu_stages skip 0 - "" "no build"
    failed=1
fi
grep -q "	fail	" "$out/.stages.tsv" 2>/dev/null && failed=1

# ---- summary ------------------------------------------------------------------------------------------------------
total=$(( $(date +%s) - t_start ))
if command -v python3 >/dev/null 2>&1; then
    python3 - "$out" "$mode" "$total" "$budget" <<'EOF'
import json, os, re, sys
out, mode, total, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as f: return json.load(f)
    except Exception: return None
def counts(log):
    try: text = open(log).read()
    except Exception: return {}
    m = re.findall(r"(\d+) passed, (\d+) failed", text)
    return {"passed": sum(int(a) for a, _ in m), "failed": sum(int(b) for _, b in m)} if m else {}
def key(name, log):
    r = load(name)
    if name in ("kda_k3_nosplit", "kda_k3_noprepass", "kda_k3_split"): r, name = load(name + "/kda"), "kda"
    if name == "parity":   # the pass counts, and the peak device memory of the K3 KDA backward case
        c = counts(log)
        try: m = re.search(r"kda backward memory K3 T 64K\s+\S+\s+peak ([0-9.]+) GiB; the backward's own \+(-?[0-9]+) MiB", open(log).read())
        except Exception: m = None
        if m: c.update({"kda_k3_64k_peak_gib": float(m.group(1)), "kda_k3_64k_backward_extra_mib": int(m.group(2))})
        return c
    if name.startswith("emu_"): return counts(log)
    if not r: return {}
    if name == "step_dense":
        c = r["configs"][0]; t = c["tide"]
        return {"config": c["name"], "batch": c["batch"], "seq": c["seq"], "tok_per_s": t["tok_per_s"],
                "step_s": t["step_s_median"], "forward_s": t["forward_s_median"], "backward_s": t["backward_s_median"],
                "optimizer_s": t["optimizer_s_median"], "gflops": c.get("tide_gflops"), "peak_bytes": t["memory_peak"]}
    if name == "kda":
        return {str(k["T"]): {"chunk_tok_per_s": k["chunk"]["tokens_per_s"], "chunk_s": k["chunk"]["seconds"],
                "chunk_peak_bytes": k["chunk"]["peak_bytes"], "recurrent_tok_per_s": k["recurrent"]["tokens_per_s"]}
                for k in r["kernel"]}
    if name == "mla":
        return {str(k["T"]): {"tiled_s": k["tiled"]["seconds"], "tiled_peak_bytes": k["tiled"]["peak_bytes"],
                "plain_s": k.get("plain", {}).get("seconds")} for k in r["rows"]}
    if name == "moe":
        return {str(k["tokens"]): {"moe_tok_per_s": k["moe_tokens_per_s"], "dense_tok_per_s": k["dense_tokens_per_s"],
                "moe_over_dense": k["moe_over_dense"]} for k in r["rows"]}
    if name == "quickstart_step":
        return {k["stage"]: {"tok_per_s": k["tok_per_s"], "step_s": k["step_s"], "peak_bytes": k["memory_peak"],
                "last_loss": k["losses"][-1]} for k in r["rows"]}
    return {}
rows = []
for line in open(os.path.join(out, ".stages.tsv")):
    name, status, secs, rc, log, note = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
    rows.append({"stage": name, "status": status, "seconds": float(secs), "rc": rc, "log": log, "note": note,
                 "key": key(name, log) if status == "pass" or name == "parity" else {}})
summary = {"mode": mode, "seconds": total, "budget_s": budget, "passed": all(r["status"] == "pass" for r in rows),
           "stages": rows}
with open(os.path.join(out, "summary.json"), "w") as f: json.dump(summary, f, indent=1)
def short(k):
    s = json.dumps(k, separators=(",", ":"))
    s = re.sub(r"(\d+\.\d{3})\d+", r"\1", s)
    return s if len(s) < 400 else s[:397] + "..."
md = ["# gpu_check (%s mode): %s in %d s (budget %d s)" % (mode, "all passed" if summary["passed"] else "FAILED", total, budget),
      "", "| stage | status | seconds | note | key numbers |", "|---|---|---:|---|---|"]
for r in rows:
    md.append("| %s | %s | %.1f | %s | %s |" % (r["stage"], r["status"], r["seconds"], r["note"].replace("|", "/"),
              short(r["key"]).replace("|", "/") if r["key"] else ""))
with open(os.path.join(out, "summary.md"), "w") as f: f.write("\n".join(md) + "\n")
print("\n".join(md))
EOF
else
    { echo "# gpu_check ($mode mode): $([ $failed = 0 ] && echo 'all passed' || echo FAILED) in ${total}s (no python3: no key numbers)"
      echo; echo "| stage | status | seconds | rc | note |"; echo "|---|---|---:|---:|---|"
      awk -F'\t' '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $6 }' "$out/.stages.tsv"; } | tee "$out/summary.md"
    awk -F'\t' 'BEGIN { printf "{\"mode\": \"'$mode'\", \"seconds\": '$total', \"stages\": [" }
        { gsub(/"/, "'"'"'", $6); printf "%s{\"stage\": \"%s\", \"status\": \"%s\", \"seconds\": %s, \"note\": \"%s\"}", NR > 1 ? ", " : "", $1, $2, $3, $6 }
        END { print "]}" }' "$out/.stages.tsv" >"$out/summary.json"
fi
echo "gpu_check: $([ $failed = 0 ] && echo 'every stage passed' || echo 'some stage FAILED') ($out/summary.md)"
exit $failed
