#!/usr/bin/env bash
# A release's artifacts, made from this checkout into dist/ (docs/release.md):
#   agentfast-VERSION.tgz                the Helm chart (after helm lint --strict): helm package
#   agentfast-VERSION-py3-none-any.whl   the Python package, wheel and sdist (python -m build, from
#   agentfast-VERSION.tar.gz             the venv's pinned build tools: the `release` extra, offline)
#   kubectl-agentfast-VERSION.tar.gz     the kubectl plugin: a launcher for the pip-installed CLI
#   agentfast.yaml                       its krew Plugin manifest (uri and sha256 of the archive)
#   SHA256SUMS                           of all of the above
# and, with REGISTRY=oci://HOST/PATH, the chart pushed there as an OCI artifact (helm push; users
# then `helm install agentfast oci://HOST/PATH/agentfast --version VERSION`).
#
# Settings (environment):
#   REGISTRY            oci://HOST/PATH to push the chart to; unset: no push
#   RELEASE_PLAIN_HTTP  1: the registry speaks plain HTTP (helm --plain-http; a test registry)
#   RELEASE_GITHUB_REPO OWNER/NAME of the project on GitHub (default agentfast/agentfast): the
#                       krew manifest's homepage and, by default, where its archive is downloaded
#   RELEASE_BASE_URL    where the release's files are downloaded from (default: the GitHub
#                       release vVERSION of RELEASE_GITHUB_REPO); the manifest's uri is
#                       RELEASE_BASE_URL/kubectl-agentfast-VERSION.tar.gz
#   HELM                a helm binary (default: the pinned one hack/cluster/build.sh builds)
#   RELEASE_DIST        the output folder (default dist/ in the repository; the tests use their own)
# The chart's version and appVersion, pyproject.toml's version and CHANGELOG.md's latest release
# must agree, or nothing is made. Idempotent: each run remakes this version's files in dist/
# (the chart's tarball differs by its timestamps: helm stamps the time of packaging); a push of
# the same version again moves the tag to the new digest.
PY_EXTRAS="${PY_EXTRAS-release}"
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
die() { echo "release: $*" >&2; exit 1; }
ensure_python_env
cd "$REPO"

# --- one version everywhere ------------------------------------------------------------------
chart_field() { sed -n "s/^$1:[[:space:]]*\"\{0,1\}\([^\"[:space:]]*\)\"\{0,1\}[[:space:]]*\$/\1/p" charts/agentfast/Chart.yaml | head -1; }
VERSION="$(chart_field version)"
APP_VERSION="$(chart_field appVersion)"
PY_VERSION="$(python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
# The first "## [X.Y.Z]" heading (Keep a Changelog; "## [Unreleased]" comes before it).
CHANGELOG_VERSION="$(sed -n 's/^## \[\([0-9][^]]*\)\].*/\1/p' CHANGELOG.md | head -1)"
[[ -n "$VERSION" ]] || die "no version in charts/agentfast/Chart.yaml"
for pair in "appVersion:$APP_VERSION" "pyproject.toml:$PY_VERSION" "CHANGELOG.md:$CHANGELOG_VERSION"; do
  [[ "${pair#*:}" == "$VERSION" ]] ||
    die "versions disagree: the chart is $VERSION, ${pair%%:*} says '${pair#*:}' (bump them together)"
done
echo "==> agentfast $VERSION"
[[ -z "${REGISTRY:-}" || "$REGISTRY" == oci://* ]] || die "REGISTRY must be oci://HOST/PATH (got '$REGISTRY')"

ensure_helm

DIST="${RELEASE_DIST:-$REPO/dist}"
mkdir -p "$DIST"
DIST="$(cd "$DIST" && pwd)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
CHART_TGZ="$DIST/agentfast-$VERSION.tgz"
WHEEL="$DIST/agentfast-$VERSION-py3-none-any.whl"
SDIST="$DIST/agentfast-$VERSION.tar.gz"
PLUGIN_TGZ="$DIST/kubectl-agentfast-$VERSION.tar.gz"
MANIFEST="$DIST/agentfast.yaml"
rm -f "$CHART_TGZ" "$WHEEL" "$SDIST" "$PLUGIN_TGZ" "$MANIFEST" "$DIST/SHA256SUMS"

# --- the chart -------------------------------------------------------------------------------
echo "==> helm lint --strict charts/agentfast"
"$HELM" lint --strict charts/agentfast
"$HELM" package charts/agentfast -d "$DIST" >/dev/null
[[ -f "$CHART_TGZ" ]] || die "helm package made no $CHART_TGZ"

# --- the Python package ----------------------------------------------------------------------
# No isolation: the venv's pinned setuptools and build (the `release` extra), nothing fetched.
# build makes the sdist, then the wheel from the sdist, so the sdist is known to build.
echo "==> python -m build (sdist, then the wheel from it)"
python -m build --no-isolation --outdir "$DIST" . >"$stage/build.log" 2>&1 || { cat "$stage/build.log" >&2; die "python -m build failed"; }
[[ -f "$WHEEL" && -f "$SDIST" ]] || die "python -m build made no $WHEEL / $SDIST"
# A data directory missing from pyproject.toml's packages: setuptools warns it "would be ignored"
# (and a later setuptools leaves it out): list it under [tool.setuptools] packages.
! grep -q "would be ignored" "$stage/build.log" || { grep -B2 -A8 "would be ignored" "$stage/build.log" >&2; die "setuptools: a package directory is missing from pyproject.toml's packages"; }

# --- the kubectl plugin and its krew manifest ------------------------------------------------
echo "==> kubectl plugin archive and krew manifest"
GITHUB_REPO="${RELEASE_GITHUB_REPO:-agentfast/agentfast}"
BASE_URL="${RELEASE_BASE_URL:-https://github.com/$GITHUB_REPO/releases/download/v$VERSION}"
mkdir "$stage/plugin"
sed "s/@VERSION@/$VERSION/g" hack/krew/kubectl-agentfast >"$stage/plugin/kubectl-agentfast"
chmod 0755 "$stage/plugin/kubectl-agentfast"
files=(kubectl-agentfast) license_entry=""
if [[ -f LICENSE ]]; then
  install -m 0644 LICENSE "$stage/plugin/LICENSE"
  files+=(LICENSE) license_entry="        - {from: LICENSE, to: .}"
fi
# Reproducible: sorted names, owner 0, mtime of the last commit, gzip without a timestamp.
epoch="$(git log -1 --format=%ct 2>/dev/null || echo 0)"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" -C "$stage/plugin" -cf - "${files[@]}" | gzip -n -9 >"$PLUGIN_TGZ"
sha="$(sha256sum "$PLUGIN_TGZ" | cut -d' ' -f1)"
# The template without its leading comment (which explains the placeholders), filled in.
sed -e '1,/^apiVersion:/{/^#/d}' \
    -e "s|@VERSION@|$VERSION|g" -e "s|@HOMEPAGE@|https://github.com/$GITHUB_REPO|g" \
    -e "s|@URI@|$BASE_URL/kubectl-agentfast-$VERSION.tar.gz|g" -e "s|@SHA256@|$sha|g" \
    hack/krew/agentfast.yaml.tmpl | awk -v entry="$license_entry" '$0 == "@LICENSE_FILE@" { if (entry != "") print entry; next } { print }' >"$MANIFEST"
! grep -q '@[A-Z_0-9]*@' "$MANIFEST" || die "unfilled placeholder in $MANIFEST"

# --- sums, and the OCI push --------------------------------------------------------------------
(cd "$DIST" && sha256sum "${CHART_TGZ##*/}" "${WHEEL##*/}" "${SDIST##*/}" "${PLUGIN_TGZ##*/}" "${MANIFEST##*/}" >SHA256SUMS)
if [[ -n "${REGISTRY:-}" ]]; then
  flags=()
  [[ "${RELEASE_PLAIN_HTTP:-0}" != 1 ]] || flags+=(--plain-http)
  echo "==> helm push $CHART_TGZ $REGISTRY"
  "$HELM" push "$CHART_TGZ" "$REGISTRY" "${flags[@]}" 2>&1
fi
echo "==> made in $DIST (sha256):"
sed 's/^/    /' "$DIST/SHA256SUMS"
