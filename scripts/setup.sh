#!/usr/bin/env bash
# Installs everything moetrain needs on a fresh Debian 12 machine, then configures and builds.
#   scripts/setup.sh            install dependencies + build into build/
#   SETUP_SKIP_BUILD=1 ...      install dependencies only
# Idempotent: packages already present are not reinstalled, .deps/ is reused when its
# pinned versions match.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages (bookworm versions; the names are what matter, apt pins them by release).
DEB_PACKAGES=(
  build-essential cmake ninja-build ccache git python3 python3-pip
  libtomlplusplus-dev   # 3.3.0  TOML config
  libcli11-dev          # 2.1.2  command line
  nlohmann-json3-dev    # 3.11.2 safetensors headers, HF config.json
  libfmt-dev            # 9.1.0  formatting
  libspdlog-dev         # 1.10.0 logging
  libxxhash-dev         # 0.8.1  checkpoint checksums (header-only use)
  libgtest-dev libgmock-dev googletest  # 1.12.1 tests
  libbenchmark-dev      # 1.7.1  micro benchmarks
)
# Header-only GPU libraries from PyPI, pinned, into the git-ignored .deps/ (DESIGN.md §6).
CUTLASS_VERSION=4.2.0.0
CUDNN_FRONTEND_VERSION=1.16.0

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
install_headers() {  # name version target
  local name=$1 version=$2 target=$3
  if [ -f "$target/.version" ] && [ "$(cat "$target/.version")" = "$version" ]; then return; fi
  echo "setup: pip install $name==$version -> $target"
  rm -rf "$target"
  "$PYTHON" -m pip install -q --no-deps --no-compile --target "$target" "$name==$version" \
    || "$PYTHON" -m pip install -q --break-system-packages --no-deps --no-compile --target "$target" "$name==$version"
  echo "$version" > "$target/.version"
}
install_headers nvidia-cutlass "$CUTLASS_VERSION" .deps/cutlass
install_headers nvidia-cudnn-frontend "$CUDNN_FRONTEND_VERSION" .deps/cudnn-frontend

# Python packages of scripts/tokenize_data.py (Hugging Face tokenizers, chat templates) and
# scripts/plot_metrics.py (matplotlib and what it needs), pinned, into the git-ignored
# .deps/python, which the scripts put on their path.
PY_PACKAGES="tokenizers==0.23.3 jinja2==3.1.6 markupsafe==3.0.3 matplotlib==3.9.2 numpy==2.1.3
  pillow==11.0.0 kiwisolver==1.4.7 contourpy==1.3.1 cycler==0.12.1 fonttools==4.55.0
  pyparsing==3.2.0 packaging==24.2 python-dateutil==2.9.0.post0 six==1.16.0"
PY_PACKAGES=$(echo $PY_PACKAGES)  # one line: the .version file compares it
if [ ! -f .deps/python/.version ] || [ "$(cat .deps/python/.version)" != "$PY_PACKAGES" ]; then
  echo "setup: pip install $PY_PACKAGES -> .deps/python"
  rm -rf .deps/python
  # tokenizers' huggingface_hub dependency serves from_pretrained downloads only: not installed.
  "$PYTHON" -m pip install -q --no-deps --no-compile --target .deps/python $PY_PACKAGES \
    || "$PYTHON" -m pip install -q --break-system-packages --no-deps --no-compile --target .deps/python $PY_PACKAGES
  echo "$PY_PACKAGES" > .deps/python/.version
fi

[ "${SETUP_SKIP_BUILD:-0}" = 1 ] && exit 0
BUILD_TYPE=${BUILD_TYPE:-Release}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" >/dev/null
cmake --build build --parallel "$(nproc)"
