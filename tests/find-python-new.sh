#!/usr/bin/env bash
# Prints a command that runs a Python 3.12+ interpreter (the newest JAX needs one), or nothing.
# PYTHON_NEW, when set, is taken as is.
set -uo pipefail
if [ -n "${PYTHON_NEW:-}" ]; then
  echo "$PYTHON_NEW"
  exit 0
fi
for candidate in python3.13 python3.12 "PYENV_VERSION=3.12.1 python3.12" \
    "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
  if env $candidate -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
    echo "$candidate"
    exit 0
  fi
done
