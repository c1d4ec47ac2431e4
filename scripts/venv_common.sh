# Sourced by scripts/setup_xpu_venv.sh and scripts/setup_compat_venv.sh (not run on its own).
# Expects $venv (the venv's folder), $python (the interpreter it is made from) and a say() function.

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
