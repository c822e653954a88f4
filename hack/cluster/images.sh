#!/usr/bin/env bash
# Make every container image the local cluster needs, with no container registry:
#   registry.k8s.io/pause:<v>        upstream pause.c (from the k8s.io/kubernetes module), static
#   registry.k8s.io/coredns/coredns  the CoreDNS binary built by build.sh
#   python:3.11-slim-bookworm        a Debian bookworm rootfs made by debootstrap (python3 is 3.11)
#   agentfast:dev                    the project's real Dockerfile, built FROM the image above
#   agentfast-testing:dev            its testing target: agentfast:dev plus agentfast.testing
#   agentfast-team-tools:dev         `agentfast init`'s package, built FROM agentfast:dev (a team's tools)
# and import them into containerd's k8s.io namespace, where the kubelet finds them.
# Installs containerd, runc, CNI plugins, docker.io and debootstrap from Debian if missing.
# Idempotent: each image is remade only when its inputs changed.
# shellcheck source=hack/cluster/lib.sh
. "$(dirname "$0")/lib.sh"

IMG_DIR="$AGENTFAST_CACHE/images"
WHEEL_DIR="$AGENTFAST_CACHE/wheels"
mkdir -p "$IMG_DIR" "$WHEEL_DIR"

install_host_packages() {
  local pkgs=(containerd runc containernetworking-plugins docker.io debootstrap iptables conntrack
    socat ethtool kmod gcc libc6-dev)
  local missing=() p
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep >/dev/null 'install ok installed' || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "apt: installing ${missing[*]}"
    [ "$(id -u)" = 0 ] || die "run as root (apt-get install ${missing[*]})"
    apt-get update -qq
    # policy-rc.d keeps the packages' init scripts from starting daemons; these scripts start them.
    DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# image_id REF: the docker image id, or nothing.
image_id() { docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# input_hash FILES...: a stamp for the inputs of an image.
input_hash() { cat "$@" | sha256sum | cut -c1-16; }

make_pause() {
  local src="$GOMODCACHE/k8s.io/kubernetes@$K8S_VERSION/build/pause/linux/pause.c"
  if [ ! -f "$src" ]; then
    go mod download "k8s.io/kubernetes@$K8S_VERSION" >/dev/null
  fi
  [ -f "$src" ] || die "pause.c not found in k8s.io/kubernetes@$K8S_VERSION"
  local tag="${PAUSE_IMAGE##*:}" h
  h="$(input_hash "$src")-$tag"
  if [ -n "$(image_id "$PAUSE_IMAGE")" ] && [ "$(cat "$IMG_DIR/pause.stamp" 2>/dev/null)" = "$h" ]; then
    log "image $PAUSE_IMAGE: up to date"; return
  fi
  log "image $PAUSE_IMAGE: building from upstream pause.c"
  local d="$IMG_DIR/pause"
  rm -rf "$d"; mkdir -p "$d/rootfs"
  # The upstream Makefile's flags: -Os -Wall -Werror -static -DVERSION=v$(TAG)-$(REV).
  gcc -Os -Wall -Werror -static -DVERSION="v$tag-agentfast" -o "$d/rootfs/pause" "$src"
  strip "$d/rootfs/pause"
  tar -C "$d/rootfs" -c . | docker import \
    --change 'ENTRYPOINT ["/pause"]' --change 'USER 65535:65535' - "$PAUSE_IMAGE" >/dev/null
  echo "$h" >"$IMG_DIR/pause.stamp"
}

make_coredns() {
  local bin="$BIN_DIR/coredns" h
  [ -x "$bin" ] || die "$bin missing: run hack/cluster/build.sh"
  h="$(input_hash "$bin")"
  if [ -n "$(image_id "$COREDNS_IMAGE")" ] && [ "$(cat "$IMG_DIR/coredns.stamp" 2>/dev/null)" = "$h" ]; then
    log "image $COREDNS_IMAGE: up to date"; return
  fi
  log "image $COREDNS_IMAGE: from $bin"
  local d="$IMG_DIR/coredns"
  rm -rf "$d"; mkdir -p "$d/rootfs/etc/ssl/certs"
  cp "$bin" "$d/rootfs/coredns"
  # Like the upstream image: the binary, CA certificates, an unprivileged user.
  cp /etc/ssl/certs/ca-certificates.crt "$d/rootfs/etc/ssl/certs/" 2>/dev/null || true
  tar -C "$d/rootfs" -c . | docker import \
    --change 'ENTRYPOINT ["/coredns"]' --change 'USER 65532:65532' --change 'EXPOSE 53 53/udp' \
    - "$COREDNS_IMAGE" >/dev/null
  echo "$h" >"$IMG_DIR/coredns.stamp"
}

debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local m
  m="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {print $2}' | grep -v security | head -n1)"
  [ -n "$m" ] || m="$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -n1)"
  echo "${m:-http://deb.debian.org/debian}"
}

make_python_base() {
  local h
  h="$(echo "bookworm python3 python3-venv v2" | sha256sum | cut -c1-16)"
  if [ -n "$(image_id "$PYTHON_BASE_IMAGE")" ] && [ "$(cat "$IMG_DIR/python.stamp" 2>/dev/null)" = "$h" ]; then
    log "image $PYTHON_BASE_IMAGE: up to date"; return
  fi
  local mirror d="$IMG_DIR/python-rootfs"
  mirror="$(debian_mirror)"
  log "image $PYTHON_BASE_IMAGE: debootstrap bookworm from $mirror"
  # An interrupted debootstrap leaves /proc and /sys mounted in the target: unmount before removing.
  awk -v d="$d/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r | xargs -r -n1 umount -l
  rm -rf "$d"; mkdir -p "$d"
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$d" "$mirror" >"$IMG_DIR/debootstrap.log" 2>&1 \
    || { tail -n 30 "$IMG_DIR/debootstrap.log" >&2; die "debootstrap failed (log: $IMG_DIR/debootstrap.log)"; }
  # Slim it the way the official slim images are: no apt lists, docs, man pages or locales.
  cat >"$d/etc/apt/sources.list" <<SRC
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian}/debian-security bookworm-security main
SRC
  rm -rf "$d"/var/lib/apt/lists/* "$d"/var/cache/apt/*.bin "$d"/var/cache/apt/archives/*.deb \
    "$d"/usr/share/doc/* "$d"/usr/share/man/* "$d"/usr/share/info/* "$d"/var/log/*.log \
    "$d"/var/cache/debconf/*-old "$d"/var/lib/dpkg/*-old
  find "$d/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
  find "$d" -name '__pycache__' -prune -exec rm -rf {} +
  : >"$d/etc/resolv.conf"; echo "localhost" >"$d/etc/hostname"
  tar --numeric-owner -C "$d" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$PYTHON_BASE_IMAGE" >/dev/null
  rm -rf "$d"
  echo "$h" >"$IMG_DIR/python.stamp"
}

# The project image, from the repository's own Dockerfile. A build container reaches PyPI here only
# through a TLS-intercepting proxy whose CA is in the host's trust store, not the image's; rather
# than put that CA into the image, wheels are made on the host with pip (which trusts it) and
# handed to the Dockerfile's offline path in ./.wheels of a staged context.
make_project_image() {
  local ctx="$IMG_DIR/context"
  rm -rf "$ctx"; mkdir -p "$ctx"
  # Tracked and untracked-but-not-ignored files: exactly what the checkout holds.
  # Top-level names that .dockerignore excludes are left out, so that editing docs or scripts does
  # not count as a change of the image.
  local ignore
  ignore="$(grep -E '^[A-Za-z0-9._-]+$' "$REPO_ROOT/.dockerignore" 2>/dev/null | sed 's/[.]/[.]/g' | paste -sd'|' || true)"
  (cd "$REPO_ROOT" && git ls-files -z --cached --others --exclude-standard) |
    { if [ -n "$ignore" ]; then grep -zvE "^($ignore)(/|$)"; else cat; fi; } |
    (cd "$REPO_ROOT" && { xargs -0 -r cp --parents -t "$ctx" 2>/dev/null || true; })
  cp "$REPO_ROOT/Dockerfile" "$REPO_ROOT/.dockerignore" "$ctx/"
  # Empty package folders too (git does not track folders; setuptools' package-dir wants them).
  (cd "$REPO_ROOT" && find runner operator testing -type d -print0 2>/dev/null) | (cd "$ctx" && xargs -0 -r mkdir -p)
  # pyproject.toml names README.md as the long description; tolerate a tree that lacks it yet.
  [ -f "$ctx/README.md" ] || echo "# agentfast" >"$ctx/README.md"
  local h
  h="$( (cd "$ctx" && find . -type f ! -path './.wheels/*' -print0 | sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-16)"
  h="$h-$(image_id "$PYTHON_BASE_IMAGE" | cut -c8-20)"
  if [ -n "$(image_id "$PROJECT_IMAGE")" ] && [ -n "$(image_id "$TESTING_IMAGE")" ] \
     && [ "$(cat "$IMG_DIR/project.stamp" 2>/dev/null)" = "$h" ]; then
    log "images $PROJECT_IMAGE, $TESTING_IMAGE: up to date ($(cat "$IMG_DIR/project.ref" "$IMG_DIR/testing.ref" 2>/dev/null | paste -sd' '))"
    return
  fi
  # The context gets exactly the wheels of this resolution: $WHEEL_DIR keeps every version ever
  # built (a cache, read through --find-links), and two versions of one package in the context
  # make the image's `pip install /wheels/*.whl` impossible (durationpy 0.11 and 0.12 did).
  log "wheels: pip wheel .[operator,langgraph,otel] -> $ctx/.wheels (cache $WHEEL_DIR)"
  local py="${PYTHON:-python3}"
  mkdir -p "$WHEEL_DIR" "$ctx/.wheels"
  "$py" -m pip wheel --quiet --wheel-dir "$ctx/.wheels" --find-links "$WHEEL_DIR" "${ctx}[operator,langgraph,otel]" >&2
  # The build backend, for the isolated build of the project itself inside the image.
  "$py" -m pip download --quiet --dest "$ctx/.wheels" --find-links "$WHEEL_DIR" --only-binary=:all: "setuptools>=77" wheel >&2
  rm -f "$ctx/.wheels"/agentfast-*.whl
  cp -n "$ctx/.wheels"/*.whl "$WHEEL_DIR/"
  log "image $PROJECT_IMAGE: docker build (Dockerfile of the repository)"
  docker build --network none -t "$PROJECT_IMAGE" -f "$ctx/Dockerfile" "$ctx" >"$IMG_DIR/docker-build.log" 2>&1 \
    || { tail -n 40 "$IMG_DIR/docker-build.log" >&2; die "docker build failed (log: $IMG_DIR/docker-build.log)"; }
  log "image $TESTING_IMAGE: docker build --target testing (the same stages, plus test support)"
  docker build --network none --target testing -t "$TESTING_IMAGE" -f "$ctx/Dockerfile" "$ctx" \
    >>"$IMG_DIR/docker-build.log" 2>&1 \
    || { tail -n 40 "$IMG_DIR/docker-build.log" >&2; die "docker build --target testing failed (log: $IMG_DIR/docker-build.log)"; }
  # Keep the build stage tagged (its dependency layer is the cache of the next build; the build
  # is all cached layers, a second), then drop what earlier builds left untagged: their build
  # stages (labelled in the Dockerfile) and a previous agentfast:dev.
  docker build --network none --target build -t "${PROJECT_IMAGE%:*}:build-cache" -f "$ctx/Dockerfile" "$ctx" \
    >>"$IMG_DIR/docker-build.log" 2>&1 || true
  docker image prune -f --filter label=agentfast.stage=build >/dev/null 2>&1 || true
  docker image prune -f --filter label=org.opencontainers.image.title=agentfast >/dev/null 2>&1 || true
  docker image prune -f --filter label=org.opencontainers.image.title=agentfast-testing >/dev/null 2>&1 || true
  # A second tag that names this build, so that `helm upgrade` with it replaces running pods
  # (the same tag on new content would leave them on the old image).
  local image ref
  for image in "$PROJECT_IMAGE" "$TESTING_IMAGE"; do
    ref="${image%:*}:dev-$(image_id "$image" | cut -c8-19)"
    docker tag "$image" "$ref"
    echo "$ref" >"$IMG_DIR/$(ref_file "$image")"
  done
  echo "$h" >"$IMG_DIR/project.stamp"
}

# A team's image of its own tools, FROM this build of the production image. Made every time (a
# few seconds: init's output is the same, so docker's cache keeps the layers and the image id).
make_team_image() {
  local base
  base="$(cat "$IMG_DIR/project.ref" 2>/dev/null || echo "$PROJECT_IMAGE")"
  log "image $TEAM_IMAGE: agentfast init + docker build FROM $base"
  build_team_tools_image "$base" "$TEAM_IMAGE" "$IMG_DIR/team" >>"$IMG_DIR/docker-build.log" 2>&1 \
    || { tail -n 40 "$IMG_DIR/docker-build.log" >&2; die "team tools image failed (log: $IMG_DIR/docker-build.log)"; }
}

# Copy docker's images into containerd's k8s.io namespace (the kubelet's), when they changed.
import_to_containerd() {
  local ref id stampf todo=()
  # The python base image too: up.sh's in-cluster network check runs in it.
  for ref in "$PAUSE_IMAGE" "$COREDNS_IMAGE" "$PYTHON_BASE_IMAGE" "$PROJECT_IMAGE" "$TESTING_IMAGE" "$TEAM_IMAGE" \
             $(cat "$IMG_DIR/project.ref" "$IMG_DIR/testing.ref" 2>/dev/null); do
    id="$(image_id "$ref")"
    stampf="$IMG_DIR/imported-$(echo "$ref" | tr '/:' '__')"
    if [ "$(cat "$stampf" 2>/dev/null)" = "$id" ] && ctr -n k8s.io images ls -q | grep -x >/dev/null "$(normalize_ref "$ref")"; then
      log "containerd k8s.io: $ref up to date"; continue
    fi
    todo+=("$ref")
  done
  [ "${#todo[@]}" -gt 0 ] || return 0
  log "containerd k8s.io: importing ${todo[*]}"
  # One archive: layers shared by several tags are written once.
  docker save "${todo[@]}" | ctr -n k8s.io images import - >/dev/null
  for ref in "${todo[@]}"; do
    image_id "$ref" >"$IMG_DIR/imported-$(echo "$ref" | tr '/:' '__')"
  done
}

# ref_file IMAGE: the file under $IMG_DIR naming IMAGE's per-build tag.
ref_file() {
  if [ "$1" = "$TESTING_IMAGE" ]; then echo testing.ref; else echo project.ref; fi
}

# Drop the per-build tags of earlier builds (docker and containerd), keeping the current ones.
prune_old_project_tags() {
  local image cur old
  for image in "$PROJECT_IMAGE" "$TESTING_IMAGE"; do
    cur="$(cat "$IMG_DIR/$(ref_file "$image")" 2>/dev/null || true)"
    [ -n "$cur" ] || continue
    for old in $(docker images --format '{{.Repository}}:{{.Tag}}' "${image%:*}" | grep -e ':dev-' || true); do
      [ "$old" = "$cur" ] || docker rmi "$old" >/dev/null 2>&1 || true
    done
    for old in $(ctr -n k8s.io images ls -q | grep -e "$(normalize_ref "${image%:*}"):dev-" || true); do
      [ "$old" = "$(normalize_ref "$cur")" ] || ctr -n k8s.io images rm "$old" >/dev/null 2>&1 || true
    done
  done
}

# The name containerd stores for a docker reference: docker.io/library/NAME:TAG for short names.
normalize_ref() {
  local r="$1"
  case "$r" in
    */*/*|*.*/*|localhost/*) echo "$r" ;;
    */*) echo "docker.io/$r" ;;
    *) echo "docker.io/library/$r" ;;
  esac
}

start=$SECONDS
# Steps may be named to run only those: images.sh [packages] [pause] [coredns] [python] [project] [team] [import]
steps=("$@")
[ "${#steps[@]}" -gt 0 ] || steps=(packages pause coredns python project team import)
install_host_packages
ensure_dockerd
for step in "${steps[@]}"; do
  case "$step" in
    packages) ;;
    pause) make_pause ;;
    coredns) make_coredns ;;
    python) make_python_base ;;
    project) make_project_image ;;
    team) make_team_image ;;
    import) import_to_containerd; prune_old_project_tags ;;
    *) die "unknown step: $step" ;;
  esac
done
log "images ready ($((SECONDS - start))s)"
docker images --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' >&2
