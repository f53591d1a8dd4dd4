#!/usr/bin/env bash
# What the page tests (tests/page/test_page_browser.py) need: Debian's Chromium and its chromedriver (no browser
# is downloaded by anything else), a font, and Selenium in the venv. Run as root; idempotent.
#   bash tests/page/install_browser.sh            # uses .venv/bin/python
#   PYTHON=/path/to/python bash tests/page/install_browser.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "install-browser: installing Debian's chromium and chromium-driver with apt-get (the page tests' browser," \
        "about 100 MB, once)"
    # Each package apt-get fetches and sets up is a line, and one at least every 30 s (tools/progress).
    "$PYTHON" tools/progress --label install-browser -- $SUDO apt-get update -q
    "$PYTHON" tools/progress --label install-browser --only '^(Get:|Setting up|Unpacking|E:)' -- \
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver fonts-dejavu-core
fi
"$PYTHON" -c 'import selenium' 2>/dev/null || { echo "install-browser: installing Selenium into the venv";
    "$PYTHON" -m pip install -q 'selenium>=4.20'; }
chromium --version
chromedriver --version
"$PYTHON" -c 'import selenium; print("selenium", selenium.__version__)'
