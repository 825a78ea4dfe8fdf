#!/usr/bin/env bash
# The programs the end-to-end tests drive besides Python packages: Prometheus (the metrics
# dashboard's queries) and headless Chromium (the TensorBoard pages). Installs the missing ones
# with apt when it can (as root, or with sudo that asks no password); otherwise stops at once
# with the command to run. The tests themselves fail, never skip, without them.
set -euo pipefail

missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
  || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    as_root=(none)
  fi
fi
if command -v apt-get >/dev/null 2>&1 && [ "${as_root[0]:-}" != none ]; then
  echo "make test: installing ${missing[*]} (apt-get), which the end-to-end tests need" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  exit 0
fi
{
  echo "make test: the end-to-end tests need ${missing[*]}, which are not installed."
  if command -v apt-get >/dev/null 2>&1; then
    echo "Run:  sudo apt-get install -y --no-install-recommends ${missing[*]}"
  else
    echo "Install them with your package manager (Homebrew: brew install prometheus;" \
      "brew install --cask chromium), then run make test again."
  fi
} >&2
exit 1
