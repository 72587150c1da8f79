# fusex — the two commands a fresh machine needs are `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
# Every build and test uses the committed lockfiles as they are: one that is out of date fails
# instead of being rewritten (a clean clone stays clean).
LOCKED := --locked
DEMO_DIR := demo
DEMO_IMG := $(DEMO_DIR)/disk.img
DEMO_MNT := $(DEMO_DIR)/disk.raw

.PHONY: all build release deps run test check unit e2e bench bench-quick bench-deps bench-smoke stress fuzz fmt clean install

# make install: PREFIX (default /usr/local), DESTDIR for staging; INSTALL_BIN installs an already
# built binary instead of building the release one.
PREFIX ?= /usr/local
DESTDIR ?=
INSTALL_BIN ?=

all: build

deps:
	@bash scripts/deps.sh

build:
	$(CARGO) build --workspace

release:
	$(CARGO) build $(LOCKED) --release -p fusex

## make run: build, create a 256 MiB demo image and export it at ./demo/disk.raw (foreground).
run: deps release
	@mkdir -p $(DEMO_DIR)
	@[ -f $(DEMO_IMG) ] || truncate -s 256M $(DEMO_IMG)
	@echo "exporting $(DEMO_IMG) at $(DEMO_MNT) (Ctrl-C to unmount). In another shell, try:"
	@echo "  stat $(DEMO_MNT)"
	@echo "  mkfs.ext4 -q $(DEMO_MNT) && mkdir -p /mnt/demo && mount -o loop $(DEMO_MNT) /mnt/demo"
	@echo "  fio --name=t --filename=$(DEMO_MNT) --rw=randread --bs=4k --direct=1 --runtime=5 --time_based"
	@echo "  umount /mnt/demo; ./target/release/fusex umount $(DEMO_MNT)"
	./target/release/fusex mount --writable $(DEMO_IMG) $(DEMO_MNT)

## make test: everything CI runs (formatting, lints, unit tests, real-mount end-to-end tests, bench smoke).
## The smoke run uses the debug binary the end-to-end tests built: it checks the benchmark runner
## end to end, not speed, and a release build (fat LTO, one codegen unit) takes 5 minutes here.
test: deps check unit e2e
	FUSEX=$(CURDIR)/target/debug/fusex bash bench/smoke.sh

# fuzz/ is its own workspace (libFuzzer stays out of the main one): checked and tested on stable
# without its libFuzzer entry points, sharing target/ with the workspace.
FUZZ_CARGO := CARGO_TARGET_DIR=$(CURDIR)/target $(CARGO)
FUZZ_MANIFEST := --manifest-path fuzz/Cargo.toml --no-default-features

check:
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check
	$(CARGO) clippy $(LOCKED) --workspace --all-targets -- -D warnings
	$(FUZZ_CARGO) clippy $(LOCKED) $(FUZZ_MANIFEST) --all-targets -- -D warnings
	bash scripts/imago-diff.sh --check
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc $(LOCKED) --workspace --no-deps

unit:
	$(CARGO) test $(LOCKED) --workspace --exclude fusex-e2e
	$(FUZZ_CARGO) test $(LOCKED) $(FUZZ_MANIFEST)
	python3 -m unittest discover -s bench/tests -t bench

# The end-to-end suite runs once per transport (scripts/e2e.sh). FUSE-over-io_uring needs
# enable_uring=Y, which `make deps` sets where it may.
e2e:
	bash scripts/e2e.sh

## make stress: long verified fio storms on every transport, read mode and queue count, then the
## end-to-end suite a few times (STRESS_SECONDS=60 per storm, STRESS_E2E_ROUNDS=3: ~25 minutes).
stress: deps release build
	bash scripts/stress.sh

## make fuzz: every fuzz target (request decoder; protocol server on /dev/fuse and io_uring framing,
## for image and directory exports; the NBD client's reply parsers; the qcow2 integrity pass; the
## image formats and partition tables; QMP input and key=value options) for FUZZ_SECONDS each (default 600), one after another;
## installs nightly and cargo-fuzz if missing. Not part of `make test`. See docs/design.md.
fuzz:
	bash scripts/fuzz.sh

bench-smoke: release
	bash bench/smoke.sh

## make bench: the full benchmark suite (every matrix, 2 s jobs after 1 s ramp, 3 rounds: ~65
## minutes here, ~15 of them the qcow2 matrix; drop --runtime/--ramp for the 5 s default, ~100
## minutes). Results in bench/results/.
bench: bench-deps release
	bench/.venv/bin/python bench/run.py --matrix all --runtime 2 --ramp 1

bench-quick: bench-deps release
	bash bench/quick.sh

bench-deps:
	@bash scripts/deps.sh --bench
	@bash bench/setup.sh

## make install: the binary (without its debug info: 6 MB instead of 44; the build keeps it in
## target/release/fusex), its man pages (fusex.1 and fusex-SUBCOMMAND.1: crates/fusex/man/*.1.in
## with the options from the command line definitions) and bash/zsh/fish completions, both
## written by the binary itself, under $(DESTDIR)$(PREFIX).
install:
	@set -euo pipefail; \
	bin="$(INSTALL_BIN)"; \
	if [ -z "$$bin" ]; then $(CARGO) build --release -p fusex; bin=target/release/fusex; fi; \
	root="$(DESTDIR)$(PREFIX)"; \
	gen=$$(mktemp -d); trap 'rm -rf "$$gen"' EXIT; \
	"$$bin" generate man "$$gen/man"; \
	for sh in bash zsh fish; do "$$bin" generate completions $$sh "$$gen/completions"; done; \
	install -d "$$root/bin"; \
	strip --strip-debug -o "$$root/bin/fusex.tmp" "$$bin"; chmod 755 "$$root/bin/fusex.tmp"; \
	mv -f "$$root/bin/fusex.tmp" "$$root/bin/fusex"; \
	install -d "$$root/share/man/man1"; \
	install -m644 "$$gen"/man/*.1 "$$root/share/man/man1/"; \
	install -Dm644 "$$gen/completions/fusex.bash" "$$root/share/bash-completion/completions/fusex"; \
	install -Dm644 "$$gen/completions/_fusex" "$$root/share/zsh/site-functions/_fusex"; \
	install -Dm644 "$$gen/completions/fusex.fish" "$$root/share/fish/vendor_completions.d/fusex.fish"; \
	echo "installed fusex, its man pages and completions under $$root"

fmt:
	$(CARGO) fmt --all
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml

clean:
	$(CARGO) clean
	rm -rf $(DEMO_DIR)
