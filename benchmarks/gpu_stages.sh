#!/usr/bin/env bash
# The stages of a sitting on a lent GPU (docs/gpu.md, "Measuring on a lent GPU within its
# time"), one per device call, after the offline bundle is unpacked in ~/b. Results go to $OUT.
#
#   bash benchmarks/gpu_stages.sh STAGE
#
# parity   the first request's parts, then drafting off against plain mlx-lm, all 80 MT-bench
#          questions (issue 25)
# grounded drafting off and n-gram on the whole input-grounded set
# mtbench [DRAFTERS [SECONDS]]  drafters (default none,ngram: issue 25's n-gram goal) on all 80
#          MT-bench questions in the default dtype, each output against plain mlx-lm
# load     aggregate throughput at 1, 4, 16, 64 clients, and the verifier alone (issue 28)
# clients [TEMPERATURE [DRAFTERS [REQUESTS [VERIFIER_ARGS]]]]  drafting off and n-gram (or DRAFTERS, e.g.
#          eagle3-tree,none) at 1, 16 and 64 clients beside mlx-lm batched (issue 28); with
#          TEMPERATURE (e.g. 0.7) sampled, each request seeded by its prompt; REQUESTS per
#          client (default 1: a level of 16 lasts ~1 s, and mlx-lm's own rate there moved 2x
#          between two runs of one sitting, run AO; 3 makes the steady part count);
#          VERIFIER_ARGS added to the verifier's (e.g. "--prefill-between-steps 8")
# drafters [SECONDS [DRAFTERS [in-process|pinned|"" [BENCH_ARGS]]]]  model drafters (default eagle3-k6)
#          against drafting off and plain mlx-lm, every 4th MT-bench question; a verifier's
#          start takes ~95 s (run BH), the first stack's alone and then the others' side by
#          side, and --time-limit counts them: give SECONDS ~200 more than the questions
#          need; in-process also runs each question's
#          rounds in the bench's own process, the target served with the stack's verifier
#          settings (one GPU context beside the services' two: whether the split costs the
#          verify); pinned turns adaptive k off (--no-adaptive), so a tree drafter drafts its
#          trees every round; BENCH_ARGS added to the bench's (e.g. '--verifier-args
#          "--log-stats 1"'), its logs' load lines then copied to $OUT/drafters-load.log
# before-after PATCH [DRAFTERS [SECONDS [after-first]]]  the same bench (every 8th MT-bench
#          question, k pinned; default eagle3-k3,none) with the carried PATCH (git diff OLD NEW
#          of the code) reversed, then applied again (after-first: the tree as it is, then
#          reversed): two commits side by side on one machine; a side
#          starts its first stack, then the others side by side (a verifier's start ~95 s on
#          a fresh machine), so SECONDS (default 250) under ~200 gets no table, only the
#          verifiers' load lines ($OUT/SIDE-load.log)
# round-profile [DRAFTER [K]]  where a served round's time goes (benchmarks/round_profile.py:
#          py-spy on each service, the verifier's load lines); carry py-spy's wheel as
#          .gpu/pyspy/py_spy-*.whl (pip download py-spy --no-deps --only-binary=:all:)
# heads    the EAGLE-3 head's chains, trees and extends on the GPU (MLX) against the host
#          (numpy and specd's compiled kernels), per k (issue 26: a chain must cost well under
#          a target step), with the host's caches warm and written over before each call
# rows     the few-row product kernel against MLX's products (gpu_ops.py: cost per op, rows
#          equal to one-row products bit for bit), then forwards of N tokens against N decode
#          steps, the model's own and row by row, at 512, 1020 and 2048 tokens of context
#          (gpu_forwards.py: cost, max |dlogit|)
# compiled forwards of N tokens at 512 and 900 tokens of context: the model's own and
#          specd.models.compiled's (the work between attentions under mx.compile), its
#          attention in MLX's chunks of three rows and in one launch (row_attention): cost,
#          build time, decode rate, rows against decode steps (gpu_forwards.py)
# verify   what a verify of 1..16 tokens and a decode call of 16 steps cost the engine as the
#          verifier serves a session, keeping the drafters' hidden rows or none, drafts
#          rejected, then every draft kept
# trees    verifies of draft trees of 2-15 drafts through the compiled forwards, the nodes
#          attending in the pool kernel's one launch a layer, then through a mask
#          (--pool-kernel off), each beside chains of as many drafts: whether a tree's verify
#          costs a chain's
# layouts  the few-row kernel's layouts (few_rows.LAYOUTS) against each other: a product's cost
#          and rows equal to one-row products bit for bit (few_rows_layouts.py), then a verify
#          of chains and trees and the pooled forward at 16 sessions with the layout before
#          (whole) and the shipped one
# mix      the pooled batch's forward with plain steps beside one verify of 0-15 drafts, at 16
#          and 64 sessions (pooled_mix.py: what a verify costs the batch)
# cpool    the compiled pooled forward (--compiled-pooled) against the model's own: the batch
#          at 16 and 64 sessions, the verifier alone with it off and on
# cpool-services [DRAFTERS]  the services with it on at 1, 16 and 64 clients
# pkernel  the pool kernel (--pool-kernel: each pooled row's attention in one launch reading
#          its session's keys in place) against the compiled pooled forward's masked
#          attention: the batch at 16 and 64 sessions, the verifier alone with it off and on
# pkernel-services [DRAFTERS]  the services (default drafting off) at 1, 16 and 64 clients,
#          with it off, then on, each beside mlx-lm batched
# pieces   the pooled attention's parts per layer (writes into the pool, the gather of each
#          session's keys, the masked attention) against the whole pooled forward, at 16 and
#          64 sessions (pooled_pieces.py: what a cheaper pooled forward must remove)
# prefills prompts arriving together (issue 28: at 16 clients prefills hold the verifier a fifth
#          of each second, run AY): a group of 5 MT-bench prompts prefilled in one job of pooled
#          sessions against the same prompts one by one and plain mlx-lm's first tokens
#          (prefill_cost.py --group 5), then each prompt alone
# pool     many clients on the KV pool: the verifier alone, the services, the fault drill (issue 28)
# kvmem    the verifier's memory with 64 sessions open and after they close, three cycles
#          (kv_memory.py; issue 28: KV per session, the peak at 64, no growth after close)
# draws [FILE]  a pooled step's 64 sampled rows: copied to the host one by one and at once,
#          drawn there, and drawn together by MLX on the device (as a GPU draws plain steps),
#          a row's cost (sampled_draws.py; issue 28's sampled clients), beside the carried
#          FILE, another verifier_svc/sampling.py (e.g. .gpu/sampling_58db207.py)
# distill [SECONDS [DTYPE]]  the target's replies to ShareGPT prompts (every user turn, the
#          whole prompt range up to 1024 tokens, in shuffled order), appended to ~/dd.jsonl
#          (resumes), for SECONDS (default 500) in DTYPE (default bfloat16)
# selfprompts [SECONDS [DTYPE [SEED [LEADS]]]]  the target's replies to user messages it writes
#          itself (--prompts self), appended to ~/ds.jsonl (resumes), for SECONDS (default 500)
#          in DTYPE (default bfloat16: 22.3k reply tok/s against float32's 15.8k, run X); a SEED
#          other than earlier machines' (0) draws messages they did not; LEADS (e.g. tasks)
#          begins each message with an opening of a request (--prompt-leads), appended to
#          ~/dl.jsonl instead, messages up to 128 tokens
# dflash [DATA [SECONDS [RECORDS [LAYERS [HELD]]]]]  the DFlash drafter, from the shipped one
#          (LAYERS, or "", deepens it first: e.g. 4), on the first
#          RECORDS (default 30000; features take 4.6 kB a token, 27 GB for 24,000 records) of DATA
#          (default ~/dd.jsonl, or carried .gpu/dd.gz.*) in its seed-0 shuffle, for SECONDS (default 480, features included); a second call on the
#          same machine resumes from its checkpoint and cached features; HELD, a file of
#          replies no stage saw (e.g. `tail -n 400 ~/dl.jsonl > ~/dl-new.jsonl` after a
#          selfprompts run with a new seed: distill appends), holds out 200 of them
#          (--held-out-data) instead of the selection's last 200, none trained on
# eagle3 [DATA [SECONDS [RECORDS [MLP_WIDTH [DRAFT_VOCAB [EPOCHS [afresh [HELD]]]]]]]]  the EAGLE-3 head, from the
#          shipped one, on the same replies; both read the target features cached in ~/feat,
#          so the second to run on the same DATA and RECORDS computes none; MLP_WIDTH (e.g.
#          3072, or "" for the shipped width) widens the head's MLP first (a wider head, one of
#          issue 26's levers); DRAFT_VOCAB (e.g. 16384) grows its draft vocabulary first;
#          EPOCHS (default 1; 2 after a finished run on the same machine goes on from it)
#          afresh chooses its draft vocabulary from DATA (--vocab-from-data: DRAFT_VOCAB, or
#          the shipped head's size, of the tokens the target predicts most there; "" keeps
#          it); HELD as for dflash
# A carried .gpu/kernels.tgz (an earlier stage's $OUT/kernels.tgz) spares compiling kernels.
# The shipped drafters' weights, moved out of the tree for the upload calls and carried as
# .gpu/e3heads and .gpu/dfdrafters, are moved back into place first (a call's tree is fresh).
set -uo pipefail
. ~/b/env.sh .
: "${OUT:?run on the device, where OUT is set}"
mkdir -p ~/.cache/specd ~/res
for weights in .gpu/e3heads:drafter_svc/eagle3/heads .gpu/dfdrafters:drafter_svc/dflash/drafters; do
  carried=${weights%%:*} shipped=${weights#*:}
  if [ -d "$carried" ]; then
    rm -rf "$shipped" && mkdir -p "$(dirname "$shipped")" && mv "$carried" "$shipped"
  fi
done
[ -f .gpu/kernels.tgz ] && tar -xzf .gpu/kernels.tgz -C ~/.cache/specd
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
# the host's CPU and load: the head on the host, and the verifier's launches, run at its speed
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
# specd's compiled kernels for this host's Python (a checkout's build is for its own Python)
python3 -c "import specd.cpu._row_kernels" 2> /dev/null \
  || python3 setup.py -q build_ext --inplace > "$OUT/kernels-build.log" 2>&1 \
  || echo "specd's kernels did not build here: $OUT/kernels-build.log"
model=$SPECD_GPU_MODEL
# distilled replies from an earlier machine: carry its $OUT/dd.gz.* parts as .gpu/dd.gz.*
# (ds, dl: the self-prompted ones likewise)
for data in dd ds dl; do
  if [ ! -s ~/$data.jsonl ] && ls .gpu/$data.gz.* > /dev/null 2>&1; then
    cat .gpu/$data.gz.* | gunzip > ~/$data.jsonl
  fi
done
bench() { python3 -m specd bench --target "$model" --max-tokens 128 "$@"; }
# pooled_off_on LOG FLAG VARIANTS...: the pooled batch at 16 and 64 sessions in pooled_mix.py's
# VARIANTS, then the verifier alone with its --FLAG off and on, into $OUT/LOG
pooled_off_on() {
  local log=$1 flag=$2
  shift 2
  for sessions in 16 64; do
    timeout 120 python3 benchmarks/pooled_mix.py --target "$model" --sessions "$sessions" \
      --drafts 0 3 15 --calls 10 --variants "$@" >> "$OUT/$log" 2>&1
  done
  for mode in off on; do
    timeout 100 python3 benchmarks/batched_decode.py --target "$model" --clients 1 16 64 \
      --verifier-args "--dtype float32 --log-stats 1 --$flag $mode" >> "$OUT/$log" 2>&1
  done
}
case "${1:-}" in
parity)
  # first on a fresh machine: where the first request after SERVING loses its time
  timeout 120 python3 benchmarks/first_request.py --target "$model" --verifier-args \
    "--dtype float32" > "$OUT/first-request.log" 2>&1
  # one stack: two would not get through all 80 questions within a call
  bench --questions mt-bench --drafter none --time-limit 400 --json ~/res/parity.json \
    > "$OUT/parity.log" 2>&1 ;;
grounded)
  bench --questions input-grounded --drafter none,ngram --time-limit 400 \
    --json ~/res/grounded.json > "$OUT/grounded.log" 2>&1 ;;
mtbench)
  bench --questions mt-bench --drafter "${2:-none,ngram}" --time-limit "${3:-540}" \
    --json ~/res/mtbench-"${2:-none,ngram}".json >> "$OUT/mtbench.log" 2>&1 ;;
load)
  timeout 360 python3 -m specd bench --target "$model" --dtype float32 --questions mt-bench \
    --max-tokens 128 --drafter none,ngram --concurrency 1,4,16,64 --concurrency-requests 1 \
    --json ~/res/load.json > "$OUT/load.log" 2>&1
  timeout 120 python3 benchmarks/batched_decode.py --target "$model" --clients 1 4 16 64 \
    --verifier-args "--dtype float32" > "$OUT/batched.log" 2>&1 ;;
clients)
  # the verifier logs its load each second: whether 64 sessions run in step (run Y)
  timeout 540 python3 -m specd bench --target "$model" --dtype float32 --questions mt-bench \
    --max-tokens 128 --drafter "${3:-none,ngram}" --concurrency 1,16,64 \
    --concurrency-requests "${4:-1}" \
    --temperature "${2:-0}" --verifier-args "--log-stats 1 ${5:-}" --json ~/res/clients"${2:-}".json \
    >> "$OUT/clients.log" 2>&1
  grep -r "round forwards" /tmp/specd-bench-* > "$OUT/clients-load.log" 2>/dev/null ;;
drafters)
  # float32 pinned: the drafters' rows compare across runs, and a verify of a few tokens is
  # exact there (row forwards); dtype auto chose the model as stored in one run of run AD,
  # whose kernels the carried archive lacked
  case "${4:-}" in
  in-process) mode=(--in-process) ;;
  pinned) mode=(--no-adaptive) ;;
  "") mode=() ;;
  *) echo "drafters: the 4th argument is in-process, pinned or nothing" >&2; exit 2 ;;
  esac
  eval "extra=(${5:-})"
  bench --dtype float32 --questions mt-bench --every 4 --drafter "${3:-eagle3-k6},none" \
    "${mode[@]}" "${extra[@]}" --time-limit "${2:-300}" --json ~/res/drafters.json \
    >> "$OUT/drafters.log" 2>&1
  logs=$(sed -n 's/.*logs in //p' "$OUT/drafters.log" | tail -1)
  [ -n "${5:-}" ] && [ -n "$logs" ] && grep -H "verify calls" "$logs"/*/verifier.log \
    >> "$OUT/drafters-load.log" ;;
before-after)
  [ -f "${2:-}" ] || { echo "before-after: give the carried patch (git diff OLD NEW)" >&2; exit 2; }
  sides="before after"
  [ "${5:-}" = after-first ] && sides="after before"
  for side in $sides; do
    if [ $side = before ]; then patch -s -R -p1 < "$2"; elif [ "$sides" = "before after" ]; then
      patch -s -p1 < "$2"; fi || exit 1
    timeout "$(( ${4:-250} + 40 ))" python3 -m specd bench --target "$model" --max-tokens 128 \
      --dtype float32 --questions mt-bench --every 8 --drafter "${3:-eagle3-k3,none}" \
      --no-adaptive --time-limit "${4:-250}" > "$OUT/$side.log" 2>&1
    echo "$side:"; grep -E "^target|OVERALL|per round|share" "$OUT/$side.log"
    logs=$(sed -n 's/.*logs in //p' "$OUT/$side.log" | head -1)
    [ -n "$logs" ] && grep -H "last 10" "$logs"/*/verifier.log > "$OUT/$side-load.log"
  done ;;
round-profile)
  spy=~/py-spy-wheel
  rm -rf "$spy" && mkdir -p "$spy" && python3 -m zipfile -e .gpu/pyspy/py_spy-*.whl "$spy" \
    || { echo "round-profile: carry py-spy's wheel as .gpu/pyspy/" >&2; exit 2; }
  binary=$(find "$spy" -name py-spy -type f | head -1) && chmod +x "$binary"
  timeout 240 python3 benchmarks/round_profile.py --target "$model" --dtype float32 \
    --drafter "${2:-eagle3}" --k "${3:-3}" --py-spy "$binary" --idle --out ~/round-profile \
    > "$OUT/round-profile.log" 2>&1 ;;
heads)
  # warm caches, then written over before each call as a served round finds them
  for mb in 0 512; do
    timeout 200 python3 benchmarks/eagle3_forwards.py --target "$model" --repeats 30 \
      --cold-caches "$mb" >> "$OUT/heads.log" 2>&1
  done ;;
rows)
  timeout 120 python3 benchmarks/gpu_ops.py --dtype float32 --rows 1 2 3 4 7 8 16 \
    > "$OUT/rows.log" 2>&1
  timeout 300 python3 benchmarks/gpu_forwards.py --model "$model" --dtypes float32 \
    --contexts 512 1020 2048 --tokens 1 2 3 4 7 8 16 --repeats 15 >> "$OUT/rows.log" 2>&1 ;;
compiled)
  timeout 420 python3 benchmarks/gpu_forwards.py --model "$model" --dtypes float32 \
    --contexts 512 900 --tokens 1 2 3 4 7 8 16 --repeats 15 \
    --variants mlx-lm compiled-chunked compiled --json "$OUT/compiled.json" > "$OUT/compiled.log" 2>&1 ;;
verify)
  # as the verifier serves a session (auto: row-by-row and compiled forwards on a GPU), with
  # the drafters' hidden rows and without, twice in turn: what a forward pays for the rows
  for pass in 1 2; do
    for rows in "" --no-rows; do
      echo "== pass $pass ${rows:-rows kept}" >> "$OUT/verify.log"
      timeout 150 python3 benchmarks/verify_cost.py --target "$model" --dtype float32 \
        --drafts 0 1 3 6 15 --calls 30 --burst 16 $rows >> "$OUT/verify.log" 2>&1
    done
  done
  # every draft kept, as a right drafter's rounds keep them
  echo "== --accept" >> "$OUT/verify.log"
  timeout 100 python3 benchmarks/verify_cost.py --target "$model" --dtype float32 \
    --drafts 0 1 3 6 15 --calls 15 --accept >> "$OUT/verify.log" 2>&1 ;;
trees)
  # chains against trees of as many drafts, a tree's nodes attending in the pool kernel's
  # one launch a layer or through a mask (--pool-kernel)
  for mode in on off; do
    echo "== --pool-kernel $mode" >> "$OUT/trees.log"
    timeout 150 python3 benchmarks/verify_cost.py --target "$model" --dtype float32 \
      --drafts 0 2 3 5 15 --trees 2 3 5 15 --calls 30 --pool-kernel "$mode" \
      >> "$OUT/trees.log" 2>&1
  done
  # a path kept: chains and trees whose drafts are the target's reply, a tree's path after
  # earlier siblings, so its KV rows are moved into place as a served tree's are
  echo "== --accept" >> "$OUT/trees.log"
  timeout 150 python3 benchmarks/verify_cost.py --target "$model" --dtype float32 \
    --drafts 0 2 3 --trees 2 3 5 15 --calls 15 --accept >> "$OUT/trees.log" 2>&1 ;;
layouts)
  timeout 150 python3 benchmarks/few_rows_layouts.py --rows 2 3 4 8 16 \
    --json "$OUT/layouts.json" > "$OUT/layouts.log" 2>&1
  timeout 60 python3 benchmarks/few_rows_layouts.py --rows 32 64 --layouts t2 t4 t4c2 \
    >> "$OUT/layouts.log" 2>&1
  for layout in whole "${2:-auto}"; do
    echo "== --few-rows-layout $layout" >> "$OUT/layouts.log"
    timeout 120 python3 benchmarks/verify_cost.py --target "$model" --dtype float32 \
      --drafts 0 3 7 15 --trees 3 5 15 --calls 20 --few-rows-layout "$layout" \
      >> "$OUT/layouts.log" 2>&1
    timeout 60 python3 benchmarks/pooled_pieces.py --target "$model" --sessions 16 --calls 20 \
      --few-rows-layout "$layout" >> "$OUT/layouts.log" 2>&1
  done ;;
mix)
  # a pooled batch of plain steps beside one verify of K drafts (ragged since 29d79a3): what
  # the verify costs the batch, at 16 and 64 sessions
  for sessions in 16 64; do
    timeout 200 python3 benchmarks/pooled_mix.py --target "$model" --sessions "$sessions" \
      --drafts 0 1 3 8 15 --calls 10 --variants own compiled >> "$OUT/mix.log" 2>&1
  done ;;
cpool)
  # the compiled pooled forward (--compiled-pooled): its batch against the model's own at 16
  # and 64 sessions, the verifier alone with it off and on
  pooled_off_on cpool.log compiled-pooled own compiled compiled own ;;
pkernel)
  pooled_off_on pkernel.log pool-kernel compiled kernel kernel compiled ;;
pkernel-services)
  for mode in off on; do
    timeout 270 python3 -m specd bench --target "$model" --dtype float32 --questions mt-bench \
      --max-tokens 128 --drafter "${2:-none}" --concurrency 1,16,64 --concurrency-requests 1 \
      --verifier-args "--log-stats 1 --pool-kernel $mode" --log-dir ~/res/pkernel-$mode \
      >> "$OUT/pkernel.log" 2>&1
  done ;;
pieces)
  timeout 200 python3 benchmarks/pooled_pieces.py --target "$model" --sessions 16 64 --calls 20 \
    > "$OUT/pieces.log" 2>&1 ;;
cpool-services)
  timeout 240 python3 -m specd bench --target "$model" --dtype float32 --questions mt-bench \
    --max-tokens 128 --drafter "${2:-none,ngram}" --concurrency 1,16,64 \
    --concurrency-requests 1 --verifier-args "--log-stats 1 --compiled-pooled on" \
    >> "$OUT/cpool.log" 2>&1 ;;
prefills)
  timeout 300 python3 benchmarks/prefill_cost.py --target "$model" --questions mt-bench \
    --every 4 --rounds 3 --group 5 > "$OUT/prefills.log" 2>&1
  timeout 200 python3 benchmarks/prefill_cost.py --target "$model" --questions mt-bench \
    --every 4 --rounds 3 >> "$OUT/prefills.log" 2>&1 ;;
pool)
  # the KV pool is the verifier's default on a GPU: the verifier alone with it, then the
  # services (drafting off and n-gram), then the fault drill at 16 sessions
  timeout 100 python3 benchmarks/batched_decode.py --target "$model" --clients 1 16 64 \
    --verifier-args "--dtype float32 --warmup minimal" > "$OUT/pool-verifier.log" 2>&1
  timeout 300 python3 -m specd bench --target "$model" --dtype float32 --questions mt-bench \
    --max-tokens 128 --drafter none,ngram --concurrency 1,4,16,64 --concurrency-requests 1 \
    --json ~/res/pool.json > "$OUT/pool-bench.log" 2>&1
  timeout 150 python3 -m specd bench --target "$model" --dtype float32 --questions mt-bench \
    --max-tokens 64 --drafter ngram --concurrency 1,16 --concurrency-requests 1 \
    --concurrency-faults --json ~/res/faults.json > "$OUT/pool-faults.log" 2>&1 ;;
kvmem)
  timeout 400 python3 benchmarks/kv_memory.py --target "$model" --sessions 64 --cycles 3 \
    --verifier-args "--dtype float32" > "$OUT/kv-memory.log" 2>&1 ;;
draws)
  timeout 150 python3 benchmarks/sampled_draws.py --target "$model" --rows 64 \
    ${2:+--compare "$2"} > "$OUT/sampled-draws.log" 2>&1 ;;
distill)
  timeout 590 python3 -m specd distill --target "$model" --out ~/dd.jsonl --conversations 100000 \
    --batch-size 512 --max-prompt-tokens 1024 --max-new-tokens 256 --dtype "${3:-bfloat16}" \
    --time-limit "${2:-500}" >> "$OUT/distill.log" 2>&1
  wc -l ~/dd.jsonl >> "$OUT/distill.log"
  gzip -c ~/dd.jsonl > ~/dd.jsonl.gz && (cd ~ && split -b 15M dd.jsonl.gz dd.gz.)
  cp ~/dd.gz.* "$OUT/" ;;
selfprompts)
  # messages run to at most 23 tokens: a cap of 64 ends a wave whose last rows ramble on;
  # begun with a request's opening they run longer
  data=ds cap=64 leads=()
  if [ -n "${5:-}" ]; then data=dl cap=128 leads=(--prompt-leads "$5"); fi
  timeout 590 python3 -m specd distill --target "$model" --out ~/$data.jsonl --prompts self \
    --conversations 60000 --batch-size 512 --max-prompt-tokens $cap --max-new-tokens 256 \
    --dtype "${3:-bfloat16}" --time-limit "${2:-500}" --seed "${4:-0}" "${leads[@]}" \
    >> "$OUT/selfprompts.log" 2>&1
  wc -l ~/$data.jsonl >> "$OUT/selfprompts.log"
  gzip -c ~/$data.jsonl > ~/$data.jsonl.gz && (cd ~ && split -b 15M $data.jsonl.gz $data.gz.)
  cp ~/$data.gz.* "$OUT/" ;;
dflash)
  out=~/df${5:+-layers$5}${6:+-held}  # a deeper drafter, another held-out set: another run
  python3 -m specd train dflash --target "$model" --out "$out" --data "${2:-$HOME/dd.jsonl}" \
    --cache-dir ~/feat --conversations "${4:-30000}" --max-len 1024 --epochs 2 --batch-size 32 --held-out 200 \
    --save-every 50 --time-limit "${3:-480}" --block-size 16 --anchors 16 ${5:+--layers "$5"} \
    ${6:+--held-out-data "$6"} \
    --init-from drafter_svc/dflash/drafters/smollm2-135m-instruct > "$OUT/dflash.log" 2>&1
  for f in "$out"/model*.safetensors; do cp "$f" "$OUT/dflash-$(basename "$f")"; done
  tar -czf "$OUT/dflash-meta.tgz" -C "$out" config.json draft_vocab.npy training.json ;;
eagle3)
  out=~/e3${5:+-mlp$5}${6:+-vocab$6}${8:+-$8}${9:+-held}  # a widened head is another run
  [ -n "${8:-}" ] && [ "$8" != afresh ] && { echo "eagle3: the 8th argument is afresh or nothing" >&2; exit 2; }
  python3 -m specd train eagle3 --target "$model" --out "$out" --data "${2:-$HOME/dd.jsonl}" \
    --cache-dir ~/feat --conversations "${4:-30000}" --max-len 1024 --epochs "${7:-1}" --batch-size 32 --held-out 200 \
    --save-every 40 --ttt-steps 6 --lr 5e-4 --time-limit "${3:-480}" ${5:+--mlp-width "$5"} ${6:+--draft-vocab "$6"} \
    ${8:+--vocab-from-data} ${9:+--held-out-data "$9"} \
    --init-from drafter_svc/eagle3/heads/smollm2-135m-instruct > "$OUT/eagle3.log" 2>&1
  for f in "$out"/model*.safetensors; do cp "$f" "$OUT/eagle3-$(basename "$f")"; done
  tar -czf "$OUT/eagle3-meta.tgz" -C "$out" config.json training.json ;;
*)
  echo "usage: bash benchmarks/gpu_stages.sh STAGE [ARGS]; the stages are listed at the top" \
    "of this file" >&2
  exit 2 ;;
esac
tar -czf "$OUT/results.tgz" -C ~ res /tmp/specd-bench-* 2>/dev/null
tar -czf "$OUT/kernels.tgz" -C ~/.cache/specd mlx-kernels 2>/dev/null
echo "stage $1 done"
