#!/usr/bin/env bash
# Install proof: the built wheel installs next to the torch a user already has and leaves
# it as it was (pyproject.toml requires a range, not a pin), the package imports and the
# backend is registered. Then, on metadata alone, pip keeps other builds of the 2.13 line
# and replaces torch of another line. Fails loudly; about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "install proof FAILED: $*" >&2; exit 1; }

echo "install proof: building the wheel"
python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "python -m build"; }
wheel=$(ls "$work"/dist/*.whl)

# A user's environment: a new venv holding torch 2.13.0 (the CPU wheel, from local disk;
# --no-compile: byte-compiling torch's files would take most of the minute)
python -m venv "$work/user"
py="$work/user/bin/python"
"$py" -m pip install --no-compile 'torch==2.13.0' >"$work/torch.log" 2>&1 || { cat "$work/torch.log"; fail "pip install torch==2.13.0"; }

# torch's version, the sha256 of its RECORD (every installed file with its hash) and the
# RECORD's modification time (a reinstall of the very same wheel rewrites it)
fingerprint() {
  "$py" - <<'PY'
import hashlib
import importlib.metadata as md

dist = md.distribution("torch")
record = next(f for f in dist.files if f.name == "RECORD" and f.parent.suffix == ".dist-info")
path = record.locate()
print(dist.version, hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
PY
}
before=$(fingerprint)
echo "torch before: $before"
"$py" -m pip install --no-compile "$wheel" >"$work/install.log" 2>&1 || { cat "$work/install.log"; fail "pip install $(basename "$wheel")"; }
after=$(fingerprint)
echo "torch after:  $after"
if grep -i "uninstalling torch" "$work/install.log"; then fail "pip replaced torch"; fi
[ "$before" = "$after" ] || fail "torch changed: before '$before', after '$after'"

# outside the repository, so the import is the installed wheel's, not the source tree's
(cd "$work" && "$py" -c "
import commfuse_compile, torch
from torch._dynamo import list_backends, lookup_backend
assert commfuse_compile.__file__.startswith('$work/user/'), commfuse_compile.__file__
assert 'commfuse' in list_backends(), list_backends()
assert lookup_backend('commfuse') is commfuse_compile.commfuse_backend
print('installed wheel: import commfuse_compile ok, backend \"commfuse\" registered, torch', torch.__version__)
") || fail "the installed wheel does not import or register its backend"

# The range on torch builds this machine cannot install: a bare venv holding only torch's
# metadata at each version, and pip's dry run of the wheel's own torch requirement (no
# index: nothing is downloaded, and "replaces" shows as no install being satisfied).
required=$(unzip -p "$wheel" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: \(torch[^;]*\)$/\1/p')
[ -n "$required" ] || fail "no torch requirement in the wheel's metadata"
python -m venv --without-pip "$work/meta"
site=$("$work/meta/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
for case in 2.13.1+cu128:keeps 2.13.0a0+git1234abc:keeps 2.13.0.dev20260301+cpu:keeps 2.14.0:replaces 2.12.1:replaces; do
  version=${case%:*} expected=${case#*:}
  rm -rf "$site"/torch-*.dist-info
  mkdir "$site/torch-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: torch\nVersion: %s\n' "$version" >"$site/torch-$version.dist-info/METADATA"
  touch "$site/torch-$version.dist-info/RECORD"
  answer=$("$py" -m pip --python "$work/meta/bin/python" install --dry-run --no-deps --no-index "$required" 2>&1)
  if grep -q "Requirement already satisfied" <<<"$answer"; then got=keeps; else got=replaces; fi
  echo "pip with $required: torch $version installed: $got it"
  [ "$got" = "$expected" ] || { echo "$answer"; fail "torch $version: expected pip to say it $expected it"; }
done
echo "install proof passed"
