#!/usr/bin/env bash
# Set up this machine (see scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec make test
