# lunakv: the two commands a newcomer needs are `make run` and `make test`.
CARGO ?= cargo
ARGS ?=

.PHONY: all build release run test lint fmt bench clean

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
## real binaries on loopback (they need the binaries built first), and the Python module's
## pytest suite (builds the wheel into .venv).
test: build
	$(CARGO) test --workspace --no-fail-fast
	bindings/python/build.sh test

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## Self-contained benchmark: starts its own master and store-client, prints GB/s, ops/s,
## p50/p99 next to this machine's memcpy and loopback-TCP limits. `make bench ARGS=--json`.
bench: release
	./target/release/lunakv bench $(ARGS)

clean:
	$(CARGO) clean
