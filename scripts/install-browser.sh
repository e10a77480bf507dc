#!/bin/sh
# Install Debian's Chromium for the browser tests (Playwright drives it through
# executable_path; `playwright install` is never used). No-op when present.
set -eu
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver
/usr/bin/chromium --version
