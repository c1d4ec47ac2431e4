# Sourced first by scripts/setup_xpu_venv.sh and scripts/setup_compat_venv.sh (not run on its own),
# with two arguments: the environment variable that may name the venv's folder, and the folder's
# default under the repository root (`source venv_common.sh XPU_VENV .venv-xpu`).
# Sets repo_root, venv, python (the interpreter the venv is made from: $PYTHON, default python3),
# started (for the closing "done in N s") and say(), which prefixes a line with the calling
# script's name.

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${!1:-$repo_root/$2}"
python="${PYTHON:-python3}"
started=$SECONDS
say() { echo "[$(basename "$0" .sh)] $*"; }

# Create the venv unless it exists.
make_venv() {
    if [[ ! -x "$venv/bin/python" ]]; then
        say "creating $venv"
        "$python" -m venv "$venv"
    fi
}

# pip install into the venv. pip warns about every local index folder that lacks a package; those
# lines are noise here.
pip_install() {
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

# The fingerprint of the given files, for a stamp that skips the pip work while they are unchanged.
files_stamp() {
    cat "$@" | sha256sum | cut -c1-16
}
