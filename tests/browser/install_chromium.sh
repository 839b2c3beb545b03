#!/usr/bin/env bash
# Install Debian's Chromium (headless screenshots of the run report) when it is missing.
# Used by `make services` and by the browser test's fixture; does nothing when it is
# already there.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium.sh: no chromium and no apt-get to install it" >&2
    exit 3
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_chromium.sh: not root and no sudo" >&2; exit 3; }
    SUDO="sudo"
fi
echo "install_chromium.sh: installing chromium"
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends \
        chromium fonts-dejavu-core >/dev/null; }; then
    echo "install_chromium.sh: apt-get could not install chromium (no package source?)" >&2
    exit 3
fi
echo "install_chromium.sh: done ($(chromium --version 2>/dev/null))"
