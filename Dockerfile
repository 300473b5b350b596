# The image the Helm chart runs: the operator (`kvtier-operator`) and the injected
# sidecar (`kvtier-sidecar`) share it. Non-root, no build tools left behind, and no
# test environment: testenv/ is a separate project that never enters it (only the
# test-only `reference-engine` target below, a separate image).
#
# BASE_IMAGE is any Debian-based image with Python >= 3.11 and its venv module:
# python:3.11-slim by default; hack/image.sh builds on a local Debian bookworm rootfs
# (python3, python3-venv), since its machines reach no registry. Both stages install
# into a venv, so the base's own Python stays untouched (PEP 668).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# A C compiler for the core's Cython-compiled hot modules (setup.py), and Python's headers
# where the base lacks them (Debian's python3 ships none); only this stage has them.
RUN headers=$(python3 -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))') && \
    apt-get update && \
    apt-get install -y --no-install-recommends gcc libc6-dev $([ "$headers" = True ] || echo python3-dev) && \
    rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvtier kvtier
COPY sidecar sidecar
COPY operator operator
COPY apps apps
RUN python3 -m venv /opt/build && \
    /opt/build/bin/pip wheel --no-cache-dir --wheel-dir /wheels ".[sidecar,operator]"

# The reference engine (`--target reference-engine`): an image for tests only, never
# pulled by users. The project's sidecar client plus the test environment's
# OpenAI-compatible engine front (kvtier_testenv.engine_front), whose prefill goes
# through the pod's own sidecar. hack/image.sh builds it beside the project's image.
# Only the engine front's modules (hack/image.sh stamps exactly these COPY lines' files).
FROM build AS reference-engine-build
COPY testenv/pyproject.toml testenv/
COPY testenv/kvtier_testenv/__init__.py testenv/kvtier_testenv/engine_front.py testenv/kvtier_testenv/engine_io.py testenv/kvtier_testenv/synthetic.py testenv/kvtier_testenv/
RUN /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./testenv

FROM ${BASE_IMAGE} AS reference-engine
RUN useradd --uid 10001 --create-home kvtier
COPY --from=reference-engine-build /wheels /wheels
RUN python3 -m venv /opt/kvtier && \
    /opt/kvtier/bin/pip install --no-cache-dir --no-index --find-links /wheels "kvtier[sidecar]" kvtier-testenv && \
    rm -rf /wheels
ENV PATH=/opt/kvtier/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 10001
ENTRYPOINT ["python", "-m", "kvtier_testenv.engine_front"]

# The project's image: the last stage, what a build without --target makes.
FROM ${BASE_IMAGE}
RUN useradd --uid 10001 --create-home kvtier
COPY --from=build /wheels /wheels
RUN python3 -m venv /opt/kvtier && \
    /opt/kvtier/bin/pip install --no-cache-dir --no-index --find-links /wheels "kvtier[sidecar,operator]" && \
    rm -rf /wheels
ENV PATH=/opt/kvtier/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 10001
ENTRYPOINT ["kvtier-operator"]
