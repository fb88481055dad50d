#!/usr/bin/env bash
# Generate the Python modules (and type stubs) of proto/ into roadlog/v1/.
# They are build output: never edited by hand, not committed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=.
mkdir -p roadlog/v1
PATH="$(dirname "$PY"):$PATH" "$PY" -m grpc_tools.protoc -I proto \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  proto/roadlog/v1/*.proto 2> >(grep -v "^Writing mypy to" >&2)
touch roadlog/v1/__init__.py
echo "[proto] generated $(ls roadlog/v1/*_pb2.py | wc -l) modules in roadlog/v1" >&2
