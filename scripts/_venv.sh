# Sourced by scripts/test, scripts/bench and .ci/run: make the virtualenv and install rvz into
# it (editable, compiled in place) only when something that affects the build changed.
#
# ensure_installed EXTRAS  (e.g. "test,docs", or "" for none)
#   VENV (default .venv) and PYTHON (default python3) pick the environment and interpreter.
#   A stamp in the venv holds a hash of the build inputs and the extras installed with them;
#   rvz is reinstalled when the hash differs, an extra is missing or a compiled module is gone.

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

build_inputs_hash() {
    # Everything the build reads: its configuration and every compiled source.
    local f
    for f in pyproject.toml setup.py rvz/_fast/*.py rvz/_fast/*.pxd rvz/_fast/*.pyx \
             examples/param_server/_table.py examples/param_server/_table.pxd; do
        if [ -f "$f" ]; then sha256sum "$f"; fi
    done | sha256sum | cut -d' ' -f1
}

ensure_installed() {
    local want=$1 stamp="$VENV/.rvz-install" hash have="" extras
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
        rm -f "$stamp"
    fi
    hash=$(build_inputs_hash)
    if [ -f "$stamp" ]; then
        have=$(sed -n 2p "$stamp")  # extras stay installed across rebuilds of rvz
        if [ "$(sed -n 1p "$stamp")" = "$hash" ] && compiled_modules_present; then
            if ! extras_cover "$have" "$want"; then
                # rvz itself is current: install the extras' requirements, not rvz again
                extras=$(merge_extras "$have" "$want")
                extra_requirements "$want" | xargs -r "$VENV/bin/python" -m pip install -q
                printf '%s\n%s\n' "$hash" "$extras" > "$stamp"
            fi
            echo "== rvz is installed and up to date in $VENV (build inputs unchanged)"
            return 0
        fi
    fi
    extras=$(merge_extras "$have" "$want")
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".${extras:+[$extras]}"
    printf '%s\n%s\n' "$hash" "$extras" > "$stamp"
    if ! compiled_modules_present; then
        echo "WARNING: rvz's compiled modules were not built: it runs the pure-Python hot paths" >&2
    fi
}

compiled_modules_present() {
    # rvz loads its compiled hot paths (not a build that skipped them, nor a cleaned tree),
    # and the example's compiled module is in place.
    env -u RVZ_NO_EXTENSIONS "$VENV/bin/python" -c \
        'import sys, rvz; sys.exit(rvz.implementation() != "compiled")' 2>/dev/null || return 1
    if [ -f examples/param_server/_table.py ]; then
        compgen -G "examples/param_server/_table.*.so" > /dev/null || return 1
    fi
}

extra_requirements() {  # the requirements of the extras in $1, from rvz's installed metadata
    "$VENV/bin/python" - "$1" <<'PY'
import sys
from importlib.metadata import requires

wanted = {e for e in sys.argv[1].split(",") if e}
for line in requires("rvz") or []:
    requirement, _, marker = line.partition(";")
    if any(f'extra == "{e}"' in marker for e in wanted):
        print(requirement.strip())
PY
}

extras_cover() {  # do the extras in $1 include every extra in $2?
    local e
    for e in ${2//,/ }; do
        case ",$1," in *",$e,"*) ;; *) return 1 ;; esac
    done
}

merge_extras() {
    printf '%s\n' ${1//,/ } ${2//,/ } | LC_ALL=C sort -u | paste -sd, -
}
