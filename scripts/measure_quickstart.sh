#!/usr/bin/env bash
# Time the README's quick start as a stranger runs it (docs/install.md, "The quick start, measured"): a fresh clone
# of REPO in DIR, a fresh venv, an empty build cache ($RLHFMEM_CACHE_DIR), the README's lines one by one, then the
# record and pass again in a new directory with the cache warm, and the README's wheel line. Each line is timed
# with `date`, with the load average after it.
#   bash scripts/measure_quickstart.sh REPO DIR        e.g. bash scripts/measure_quickstart.sh . /tmp/qs/run
set -u
REPO=$(cd "$1" && pwd); D=$2
rm -rf "$D" "$D-demo" "$D-demo2" "$D-cache"; mkdir -p "$D-cache"
export RLHFMEM_CACHE_DIR="$D-cache"
t() { local s; s=$(date +%s.%N); "$@"; local rc=$?
      echo "== rc=$rc $(echo "$(date +%s.%N) - $s" | bc) s: $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; return $rc; }
t git clone -q "$REPO" "$D"
cd "$D" && git log --oneline -1
t python3 -m venv .venv
. .venv/bin/activate
t pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
t pip install -q ".[plot]"
mkdir "$D-demo" && cp examples/tiny_ppo.py examples/test_tiny_ppo_memory.py "$D-demo/" && cd "$D-demo"
t pytest test_tiny_ppo_memory.py --rlhfmem-update-baselines
t pytest test_tiny_ppo_memory.py
sed -i 's/^BATCH = 8 /BATCH = 32 /' tiny_ppo.py
t pytest test_tiny_ppo_memory.py
mkdir "$D-demo2" && cp "$D"/examples/tiny_ppo.py "$D"/examples/test_tiny_ppo_memory.py "$D-demo2/" && cd "$D-demo2"
echo "== warm: the quick start again in a new directory, the build cache warm"
t pytest test_tiny_ppo_memory.py --rlhfmem-update-baselines
t pytest test_tiny_ppo_memory.py
echo "== the README's wheel line, in the same venv"
cd "$D" && t bash -c 'pip wheel -q --no-deps -w dist . && pip install -q --force-reinstall --no-deps "$(ls dist/*.whl)[plot]"'
cat "$RLHFMEM_CACHE_DIR/builds.log"
